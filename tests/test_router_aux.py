"""The MoE load-balancing loss, response by response, against transformers' own ``load_balancing_loss_func``
(the function TRL's ``aux_loss`` comes from) and against TRL's ``_compute_loss`` through the trainer."""

from __future__ import annotations

import pytest
import torch
from _models import build
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from longstraw_trl import UnsupportedModelError
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
    assert trainer._router_aux is None
