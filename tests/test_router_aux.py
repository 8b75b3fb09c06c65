"""The MoE load-balancing loss, response by response, against transformers' own ``load_balancing_loss_func``
(the function TRL's ``aux_loss`` comes from) and against TRL's ``_compute_loss`` through the trainer."""

from __future__ import annotations

import pytest
import torch
from _models import build
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from longstraw_trl import UnsupportedModelError, replay_logprobs
from longstraw_trl.router_aux import MicroBatchRouterAux, RouterLoadBalancing


def _layout():
    """Two groups of two rows: prompts of 5 and 3 tokens (left-padded to 5), completions of 4, 0, 2 and 3 tokens
    (right-padded to 4), TRL's `(B, P + R)` attention-mask layout."""
    prompt_lens, comp_lens, groups = [5, 5, 3, 3], [4, 0, 2, 3], [0, 0, 1, 1]
    pmax, r = 5, 4
    mask = torch.zeros(4, pmax + r)
    for b in range(4):
        mask[b, pmax - prompt_lens[b] : pmax] = 1
        mask[b, pmax : pmax + comp_lens[b]] = 1
    return prompt_lens, comp_lens, groups, pmax, mask


def test_per_response_shares_equal_transformers_load_balancing_loss():
    lb = RouterLoadBalancing(build("qwen3_moe"))
    e, layers = lb.num_experts, 3
    prompt_lens, comp_lens, groups, pmax, mask = _layout()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(layers, 4, mask.shape[1], e, generator=gen) * 2
    logits[:, 1, :pmax] = logits[:, 0, :pmax]  # the rows of a group share their prompt
    logits[:, 3, :pmax] = logits[:, 2, :pmax]
    leaf = logits.clone().requires_grad_()
    ref = load_balancing_loss_func(tuple(leaf[i].reshape(-1, e) for i in range(layers)), e, lb.top_k, mask)
    ref.backward()

    # graph-free statistics: the captured prompt tokens (all but the last) of each group, once per row, then every
    # row's replay positions [last prompt token, completion] under the mask
    def stats(x, m):
        total = None
        for i in range(layers):
            s = lb.stats(x[i].reshape(-1, e), m)
            total = s if total is None else total + s
        return total

    totals, constant = None, torch.zeros(e)
    replays = []
    for b in range(4):
        captured = logits[:, b, pmax - prompt_lens[b] : pmax - 1]
        prompt = stats(captured, None)
        width = comp_lens[b] + 1
        replay = logits[:, b, pmax - 1 : pmax - 1 + width]
        replay_mask = mask[b, pmax - 1 : pmax - 1 + width]
        part = prompt + stats(replay, replay_mask)
        totals = part if totals is None else totals + part
        constant = constant + prompt.probs
        replays.append((b, width, replay_mask))
    aux = MicroBatchRouterAux(lb, totals, constant)
    torch.testing.assert_close(aux.value(), ref.detach(), atol=1e-6, rtol=0)

    # each response's differentiable share, from its own router logits only
    value = aux.constant()
    got = torch.zeros_like(logits)
    for b, width, replay_mask in replays:
        own = logits[:, b, pmax - 1 : pmax - 1 + width].clone().requires_grad_()
        term = aux.term([own[i] for i in range(layers)], replay_mask)
        term.backward()
        got[:, b, pmax - 1 : pmax - 1 + width] = own.grad
        value = value + term.detach()
    torch.testing.assert_close(value, ref.detach(), atol=1e-6, rtol=0)
    # the gradient of every token a replay routes equals transformers'; captured prompt tokens are constants
    routed = torch.zeros(4, mask.shape[1], dtype=torch.bool)
    for b, width, _ in replays:
        routed[b, pmax - 1 : pmax - 1 + width] = True
    assert (got[:, ~routed] == 0).all()
    rel = (got[:, routed] - leaf.grad[:, routed]).norm() / leaf.grad[:, routed].norm()
    assert rel <= 1e-5, rel


def test_glm4_moe_has_no_aux_loss_to_weight():
    with pytest.raises(UnsupportedModelError, match="glm4_moe.*no load-balancing aux_loss"):
        RouterLoadBalancing(build("glm4_moe"))
    with pytest.raises(UnsupportedModelError, match="qwen3"):
        RouterLoadBalancing(build("qwen3"))


def test_trainer_refuses_an_aux_loss_the_model_does_not_compute():
    """TRL accepts `router_aux_loss_coef` on glm4_moe (its config declares `output_router_logits`) and then fails on
    the missing `aux_loss`; the trainer refuses at construction, naming the option."""
    from _trl_helpers import make_tiny_longstraw_trainer

    with pytest.raises(UnsupportedModelError, match="router_aux_loss_coef.*glm4_moe"):
        make_tiny_longstraw_trainer(model=build("glm4_moe"), router_aux_loss_coef=0.01)
    trainer = make_tiny_longstraw_trainer(
        model=build("glm4_moe")
    )  # no coefficient in its config: off, as in TRL
    assert trainer.router_aux is None


def _engine_aux(model, prompt, comps, mask):
    """The engine's path: prompt statistics at capture, the graph-free pass, then one replay per response with its
    share back-propagated. Returns (aux value, sum of the shares, grads)."""
    from longstraw_trl import capture_prompt
    from longstraw_trl.router_aux import prepare_micro_batch, replay_inputs

    lb = RouterLoadBalancing(model)
    with lb.collect() as got:
        state = capture_prompt(model, prompt, chunk_size=8, page_size=6)
    # a budget of 9 tokens: one row per graph-free forward (the trainer tests run whole groups at once)
    aux = prepare_micro_batch(lb, model, [(state, got[0], comps, mask)], max_tokens=9)
    model.zero_grad()
    total = aux.constant()
    for i in range(comps.shape[0]):
        ids, router_mask, _ = replay_inputs(comps[i], mask[i], int(mask[i].sum()))
        with lb.stash() as logits:
            replay_logprobs(state, model, ids[None], grad=True)
        term = aux.term(logits, router_mask)
        term.backward()
        total = total + term.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return aux.value(), total, grads


def _reference_aux(model, prompt, comps, mask):
    """transformers only: the full forward's `aux_loss` on TRL's `prompt + completion` rows (value), and
    `load_balancing_loss_func` on the response-only forward (prompt[:P-1] prefilled under no_grad, each row's
    `[prompt[P-1], completion]` with autograd on a copy of the cache) for the gradient."""
    import sys

    from _reference import rebinding_copy

    g = comps.shape[0]
    rows = torch.cat([prompt[None].expand(g, -1), comps], 1)
    attention = torch.cat([torch.ones(g, prompt.numel(), dtype=mask.dtype), mask], 1)
    with torch.no_grad():
        full = model(rows, attention_mask=attention, output_router_logits=True).aux_loss
        prefill = model.model(prompt[None, :-1], use_cache=True, output_router_logits=True)
    per_row = []
    for i in range(g):
        tokens = torch.cat([prompt[-1:], comps[i]])[None]
        out = model.model(
            tokens,
            past_key_values=rebinding_copy(prefill.past_key_values),
            use_cache=True,
            output_router_logits=True,
        )
        per_row.append(
            [torch.cat([p, r]) for p, r in zip(prefill.router_logits, out.router_logits, strict=True)]
        )
    layers = tuple(torch.cat(x) for x in zip(*per_row, strict=True))
    lb = sys.modules[type(model).__module__].load_balancing_loss_func
    cfg = model.config.get_text_config()
    model.zero_grad()
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts  # GPT-OSS's name
    lb(layers, experts, cfg.num_experts_per_tok, attention).backward()
    return full, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next", "gpt_oss"])
def test_engine_shares_match_transformers_aux_loss(family):
    from _models import build_hybrid, build_window, sharp_routers
    from _reference import assert_grads_close, padded_completions

    if family == "gpt_oss":
        model = sharp_routers(build_window(family))
    else:
        model = sharp_routers(build(family) if family == "qwen3_moe" else build_hybrid(family))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 97, (21,), generator=gen)
    comps, mask = padded_completions([7, 0, 4], gen)
    value, total, grads = _engine_aux(model, prompt, comps, mask)
    full, ref_grads = _reference_aux(model, prompt, comps, mask)
    torch.testing.assert_close(value, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(total, full, atol=1e-5, rtol=0)
    assert_grads_close(grads, ref_grads)
