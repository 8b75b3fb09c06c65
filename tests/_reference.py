"""References every engine test compares against: the stock HF model, never the engine itself."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from longstraw_trl import capture_prompt, replay_logprobs
from longstraw_trl.engine import StateGrads, prompt_backward, replay_blocks_backward

VOCAB = 97


def stock_logprobs(model, prompt, completions):
    """log p(completion token | prompt + prefix) from the stock model's full forward."""
    p = prompt.numel()
    full = torch.cat([prompt[None].expand(completions.shape[0], -1), completions], dim=1)
    with torch.no_grad():
        logits = model(full).logits.float()
    return torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, completions[..., None])[..., 0]


def padded_completions(lengths, gen):
    r = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), r), generator=gen)
    mask = torch.zeros(len(lengths), r, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids * mask, mask  # pad id 0 after each row's end


class _RebindingLinearAttention:
    """Test-only shim for HF's GDN cache layers: rebind the states instead of ``copy_`` into them.

    The stock layer writes the new recurrent state into the tensor the delta rule saved for backward,
    which fails with "modified by an inplace operation". Same values, no in-place write.
    """

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
        assert self.has_previous_state[state_idx] and not self.record_past, "shim only continues a prefill"
        full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -self.conv_kernel_size[state_idx] :]
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


def rebinding_copy(cache):
    """A copy of a stock cache whose GDN layers (if any) rebind their states instead of writing in place."""
    cache = copy.deepcopy(cache)
    shimmed = 0
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            cls = type(layer)
            methods = {k: v for k, v in vars(_RebindingLinearAttention).items() if k.startswith("update_")}
            layer.__class__ = type(f"Rebinding{cls.__name__}", (cls,), methods)
            shimmed += 1
    return cache


def response_only_reference(model, prompt, completion, weights):
    """Grads of sum(weights * logp): ``prompt[:P-1]`` prefilled under no_grad into the stock cache, then
    ``[prompt[P-1], completion[:-1]]`` run with autograd on a (rebinding) copy of that cache; the log-prob of
    completion token j is read at input position j, so token 0 carries gradient through every layer.

    This is the response-only reference of docs/design.md ("Correctness references"): it uses only the stock HF model and its own cache."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tokens = torch.cat([prompt[-1:], completion[:-1]])[None]
    # the stock *ForCausalLM forward: its own post-processing of the head's logits (a final soft-cap, a
    # logit scale) included
    if prompt.numel() > 1:
        with torch.no_grad():
            cache = base.model(prompt[None, :-1], use_cache=True).past_key_values
        logits = base(tokens, past_key_values=rebinding_copy(cache), use_cache=True).logits.float()
    else:
        logits = base(tokens).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, completion[None, :, None])[0, :, 0]
    model.zero_grad()
    (logp * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def param_grads(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient ``model`` holds, by name."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def engine_grads(model, state, completion, weights, **kwargs):
    model.zero_grad()
    logp = replay_logprobs(state, model, completion[None], grad=True, **kwargs)[0]
    (logp * weights).sum().backward()
    return param_grads(model)


def weighted_replay_grads(model, state, ids, mask) -> torch.Tensor:
    """All parameter gradients (one flat tensor) of each row's replay, its log-probs weighted -1 .. 1."""
    model.zero_grad()
    for i in range(ids.shape[0]):
        n = int(mask[i].sum())
        w = torch.linspace(-1, 1, n)
        (replay_logprobs(state, model, ids[i : i + 1, :n], grad=True)[0] * w).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def assert_grads_close(got, ref, tol=1e-4):
    assert got.keys() == ref.keys() and ref
    for name in ref:
        rel = (got[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
        assert rel <= tol, f"{name}: relative L2 {rel:.2e}"


def with_lora(model, targets):
    """peft LoRA with random B (``init_lora_weights=False``), so the adapters change the outputs."""
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(model, cfg)


GRAD_VARIANTS = ["full", "lora", "checkpoint_layers", "hf_gradient_checkpointing"]


def check_replay_grads(model, variant: str, lora_targets) -> dict:
    """One replay's parameter gradients against the response-only reference (relative L2 <= 1e-4).

    ``variant``: plain, with LoRA on ``lora_targets``, with the engine's per-layer checkpointing, or with HF
    gradient checkpointing on (train mode, where HF drops caches). Returns the engine's gradients.
    """
    if variant == "lora":
        model = with_lora(model, lora_targets)
    if variant == "hf_gradient_checkpointing":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (29,), generator=gen)
    completion = torch.randint(0, VOCAB, (11,), generator=gen)
    weights = torch.randn(11, generator=gen)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6)
    got = engine_grads(model, state, completion, weights, checkpoint_layers=variant == "checkpoint_layers")
    if variant == "hf_gradient_checkpointing":
        model.activation_checkpointing_disable()
        model.eval()
    assert_grads_close(got, response_only_reference(model, prompt, completion, weights))
    return got


def check_logprobs_against_stock(model, prompt_len: int, chunk: int, page: int):
    """Capture a random prompt, score 3 padded completions of different lengths, and compare each row with
    the stock model's full forward on its unpadded prompt + completion (max abs <= 1e-4). Returns the state."""
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    comps, mask = padded_completions([9, 4, 1], gen)
    state = capture_prompt(model, prompt, chunk_size=chunk, page_size=page)
    got = replay_logprobs(state, model, comps, mask)
    for i, n in enumerate(mask.sum(1).tolist()):
        ref = stock_logprobs(model, prompt, comps[i : i + 1, :n])
        assert (got[i : i + 1, :n] - ref).abs().max().item() <= 1e-4
    assert state.num_tokens == prompt_len
    return state


def stock_full_grads(model, prompt, comps, weights):
    """Gradient of sum_ij w_ij log p(c_ij | prompt, c_i<j) through the stock model's full forward (prompt live)."""
    model.zero_grad()
    p = prompt.numel()
    for i in range(comps.shape[0]):
        logits = model(torch.cat([prompt, comps[i]])[None]).logits.float()
        logp = torch.log_softmax(logits[0, p - 1 : -1], -1).gather(-1, comps[i][:, None])[:, 0]
        (logp * weights[i]).sum().backward()
    return param_grads(model)


def engine_full_grads(model, prompt, comps, weights, block_size=None, chunk_size=8, **capture):
    """The engine's full gradient of the same sum: replays (reverse block replays with ``block_size``) accumulating the
    prompt state's gradient, then the prompt backward (chunks of ``chunk_size``, pages of 6)."""
    model.zero_grad()
    state = capture_prompt(model, prompt, chunk_size=chunk_size, page_size=6, keep_boundaries=True, **capture)
    grads = StateGrads(state)
    for i in range(comps.shape[0]):
        if block_size is None:
            logp = replay_logprobs(state, model, comps[i : i + 1], grad=True, grads=grads)[0]
            (logp * weights[i]).sum().backward()
        else:
            replay_blocks_backward(
                state, model, comps[i], block_size, lambda lp, h, w=weights[i]: (lp * w).sum(), grads=grads
            )
    prompt_backward(state, model, grads)
    return param_grads(model)
