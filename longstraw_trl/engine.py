"""The prompt-boundary engine: capture a prompt once, replay responses on its read-only state.

How the state reaches the model: the engine runs the model's own decoder layers (so LoRA, MoE blocks,
norms and HF gradient checkpointing all behave as usual) and passes a :class:`ReplayContext` down as the
``longstraw`` keyword. HF attention modules forward unknown keywords to their attention interface; the
engine wraps every registered interface so that, when the keyword is present, attention runs over the
prompt pages plus the response's own causal keys (``kernels.attention``), and otherwise falls through to
the original implementation untouched. Because the context travels as a call argument, a checkpointed
layer recomputed during ``backward()`` sees the same context.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longstraw_trl.kernels.attention import prompt_response_attention
from longstraw_trl.kernels.logprob import token_logprobs
from longstraw_trl.model_patches import find_patch, patch_model, unwrap_model

from .errors import LongStrawError, PromptTooLongError
from .state import KVPages, PromptState, _storage_device

CTX_KWARG = "longstraw"

DEFAULT_CHUNK_SIZE = 8192
DEFAULT_PAGE_SIZE = 16384


# ----------------------------------------------------------------------------------------------------
# Attention dispatch
# ----------------------------------------------------------------------------------------------------
def _dispatching(fallback: Callable | None) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        ctx = kwargs.pop(CTX_KWARG, None)
        if ctx is None:
            fn = fallback or sys.modules[type(module).__module__].eager_attention_forward
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        scale = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        return ctx.attend(module, query, key, value, scale), None

    attention._longstraw_dispatch = True
    return attention


def install_attention_dispatch() -> None:
    """Wrap every attention implementation registered in transformers (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    for name, fn in list(mapping.items()):
        if not getattr(fn, "_longstraw_dispatch", False):
            mapping[name] = _dispatching(fn)
    if "eager" not in mapping:  # eager is each modeling file's own function, looked up per module
        mapping["eager"] = _dispatching(None)


# ----------------------------------------------------------------------------------------------------
# Context passed down the decoder layers
# ----------------------------------------------------------------------------------------------------
class ReplayContext:
    """What an attention (or GDN) layer needs during a LongStraw call.

    ``mode``: ``"capture"`` appends the chunk's K/V to the state after attending; ``"replay"`` only
    reads the state; ``"decode"`` also keeps per-sequence response K/V in ``response_kv`` (generation).
    """

    def __init__(self, mode: str, state: PromptState, cp=None):
        self.mode = mode
        self.state = state
        self.cp = cp if cp is not None else _cp_for(state)
        self.response_kv: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.extra: dict = {}  # family-specific per-call state (e.g. GDN decode states)

    def kv_layer(self, module: nn.Module, k: torch.Tensor, v: torch.Tensor) -> KVPages:
        idx = module.layer_idx
        layer = self.state.layers.get(idx)
        if layer is None:
            if self.mode != "capture":
                raise LongStrawError(f"layer {idx} has no captured K/V: the state belongs to another model")
            layer = KVPages(
                num_kv_heads=k.shape[1],
                head_dim=k.shape[-1],
                v_head_dim=v.shape[-1],
                page_size=self.state.page_size,
                dtype=k.dtype,
                storage=_storage_device(k.device, self.state.offload),
                cp_rank=self.cp.rank,
                cp_size=self.cp.size,
            )
            self.state.layers[idx] = layer
        return layer

    def attend(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]`` -> attention output ``[B, T, Hq, D]``."""
        layer = self.kv_layer(module, k, v)
        if self.mode == "decode":
            k, v = self._append_response_kv(module.layer_idx, k, v)
        device = q.device

        def pages():
            return layer.iter_pages(device)

        out = prompt_response_attention(
            q, k, v, pages, scale, reduce_partial=self.cp.reduce_partial, reduce_dq=self.cp.reduce_dq
        )
        if self.mode == "capture":
            layer.append(k[0], v[0])
        return out.transpose(1, 2)

    def _append_response_kv(self, idx: int, k: torch.Tensor, v: torch.Tensor):
        """Decode: keep the response's own K/V in a buffer sized for the whole generation."""
        if idx not in self.response_kv:
            cap = self.extra.get("capacity", k.shape[2])
            buf_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            buf_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            self.response_kv[idx] = (buf_k, buf_v, 0)
        buf_k, buf_v, n = self.response_kv[idx]
        t = k.shape[2]
        if n + t > buf_k.shape[2]:  # past the announced capacity: grow (amortised doubling)
            cap = max(2 * buf_k.shape[2], n + t)
            grow = lambda b: torch.cat([b[:, :, :n], b.new_empty(*b.shape[:2], cap - n, b.shape[3])], 2)  # noqa: E731
            buf_k, buf_v = grow(buf_k), grow(buf_v)
        buf_k[:, :, n : n + t] = k
        buf_v[:, :, n : n + t] = v
        self.response_kv[idx] = (buf_k, buf_v, n + t)
        return buf_k[:, :, : n + t], buf_v[:, :, : n + t]


class _SingleRank:
    rank, size = 0, 1

    @staticmethod
    def reduce_partial(out, lse, q):
        return out, lse

    @staticmethod
    def reduce_dq(dq_pages, dq_self):
        return dq_pages + dq_self


def _cp_for(state: PromptState):
    if state.cp_group is None:
        return _SingleRank()
    from .distributed import ContextParallel

    return ContextParallel(state.cp_group)


# ----------------------------------------------------------------------------------------------------
# Running the decoder stack
# ----------------------------------------------------------------------------------------------------
def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def run_decoder(
    model: nn.Module,
    input_ids: torch.Tensor,
    start: int,
    ctx: ReplayContext,
    checkpoint_layers: bool = False,
) -> torch.Tensor:
    """Final-norm hidden states ``[B, T, hidden]`` of ``input_ids`` placed at positions ``start...``."""
    base = unwrap_model(model)
    patch = find_patch(base)
    dec = patch.decoder(base)
    b, t = input_ids.shape
    h = dec.embed_tokens(input_ids)
    position_ids = patch.position_ids(start, t, b, h.device)
    position_embeddings = dec.rotary_emb(h, position_ids)
    kwargs = dict(attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
    kwargs[CTX_KWARG] = ctx
    for layer in dec.layers:
        hf_checkpoints = getattr(layer, "gradient_checkpointing", False) and layer.training
        if checkpoint_layers and torch.is_grad_enabled() and not hf_checkpoints:
            h = checkpoint(layer, h, use_reentrant=False, **kwargs)
        else:
            h = layer(h, **kwargs)
        if isinstance(h, tuple):
            h = h[0]
    return dec.norm(h)


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------
def _vocab_size(model: nn.Module) -> int:
    return unwrap_model(model).get_output_embeddings().weight.shape[0]


def check_token_ids(ids: torch.Tensor, model: nn.Module, name: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise LongStrawError(f"{name} must be an integer torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.numel() == 0:
        raise LongStrawError(f"{name} is empty: give at least one token")
    vocab = _vocab_size(model)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise LongStrawError(
            f"{name} holds token ids outside the vocabulary [0, {vocab}): min {lo}, max {hi}"
        )


def check_positions(model: nn.Module, total: int, what: str) -> None:
    limit = find_patch(model).max_positions(unwrap_model(model))
    if limit is not None and total > limit:
        raise PromptTooLongError(
            f"{what} needs {total} positions but the model's max_position_embeddings is {limit}; "
            "raise it in the config (with a RoPE scaling suited to the model) or shorten the prompt"
        )


# ----------------------------------------------------------------------------------------------------
# Capture, extend, replay
# ----------------------------------------------------------------------------------------------------
def _progress(total: int, enabled: bool | None, desc: str):
    from tqdm.auto import tqdm

    if enabled is None:
        enabled = total >= 1 << 17
    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not enabled, leave=False)


@torch.no_grad()
def _prefill(state: PromptState, model: nn.Module, ids: torch.Tensor, chunk_size: int, progress) -> None:
    device = state.device
    ctx = ReplayContext("capture", state)
    h = None
    with _progress(ids.numel(), progress, "capture") as bar:
        for s in range(0, ids.numel(), chunk_size):
            chunk = ids[s : s + chunk_size].to(device)[None]
            h = run_decoder(model, chunk, state.num_tokens, ctx)
            state.num_tokens += chunk.shape[1]
            bar.update(chunk.shape[1])
    state.last_hidden = h[0, -1].clone()


def capture_prompt(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    chunk_size: int | None = None,
    page_size: int | None = None,
    offload: str | None = None,
    cp_group=None,
    progress: bool | None = None,
) -> PromptState:
    """Capture ``prompt_ids`` (1-D) once, without autograd, into a :class:`PromptState`.

    Args:
        model: a supported causal LM (patched on the fly; peft-wrapped is fine).
        prompt_ids: 1-D LongTensor, the whole prompt.
        chunk_size: prompt tokens per prefill step (default 8192). Peak memory apart from the state
            grows with the chunk, never with the prompt.
        page_size: tokens per K/V page (default 16384).
        offload: ``None`` keeps pages on the model's device; ``"cpu"`` keeps them in pinned host memory
            and streams them to the device page by page.
        cp_group: a ``torch.distributed`` group: pages are spread round-robin over its ranks.
        progress: show a progress bar (default: only for prompts of 128K tokens or more).
    """
    patch_model(model)
    check_token_ids(prompt_ids, model, "prompt_ids")
    if prompt_ids.dim() != 1:
        raise LongStrawError(
            f"prompt_ids must be 1-D (one prompt per state), got shape {tuple(prompt_ids.shape)}"
        )
    check_positions(model, prompt_ids.numel(), f"a prompt of {prompt_ids.numel()} tokens")
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    page_size = page_size or DEFAULT_PAGE_SIZE
    if chunk_size <= 0 or page_size <= 0:
        raise LongStrawError("chunk_size and page_size must be positive")
    _storage_device(model_device(model), offload)  # validates `offload`
    state = PromptState({}, model_device(model), offload, cp_group, page_size, chunk_size)
    _prefill(state, model, prompt_ids, chunk_size, progress)
    return state


def extend_state(
    state: PromptState, model: nn.Module, more_ids: torch.Tensor, progress: bool | None = None
) -> PromptState:
    """A new state for prompt + ``more_ids``; full pages are shared with ``state``, which is unchanged."""
    state.check_not_empty()
    check_token_ids(more_ids, model, "more_ids")
    if more_ids.dim() != 1:
        raise LongStrawError(f"more_ids must be 1-D, got shape {tuple(more_ids.shape)}")
    check_positions(model, state.num_tokens + more_ids.numel(), "the extended prompt")
    new = state.fork()
    _prefill(new, model, more_ids, new.chunk_size or DEFAULT_CHUNK_SIZE, progress)
    return new


def check_completion_mask(mask: torch.Tensor, ids: torch.Tensor) -> None:
    if mask.shape != ids.shape:
        raise LongStrawError(
            f"completion_mask shape {tuple(mask.shape)} != completion_ids {tuple(ids.shape)}"
        )
    m = mask.to(torch.int64)
    if (m[:, 1:] > m[:, :-1]).any():
        raise LongStrawError("completion_mask must be right-padded (ones, then zeros) in every row")


def replay_logprobs(
    state: PromptState,
    model: nn.Module,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    grad: bool = False,
    checkpoint_layers: bool = False,
) -> torch.Tensor:
    """``[G, R]`` log-probs of ``completion_ids`` continuing the captured prompt (fp32).

    Positions past a row's mask are computed but meaningless (right padding cannot affect earlier
    tokens under causal attention). With ``grad=True`` the result carries the autograd graph of these
    rows only; ``checkpoint_layers`` recomputes each decoder layer in backward instead of storing it.
    """
    state.check_not_empty()
    if completion_ids.dim() == 1:
        completion_ids = completion_ids[None]
    check_token_ids(completion_ids, model, "completion_ids")
    if completion_mask is not None:
        check_completion_mask(completion_mask, completion_ids)
    g, r = completion_ids.shape
    check_positions(model, state.num_tokens + r, f"prompt ({state.num_tokens}) + completion ({r})")
    ids = completion_ids.to(state.device)
    with torch.set_grad_enabled(grad):
        last = state.last_hidden.expand(g, 1, -1)
        if r > 1:
            ctx = ReplayContext("replay", state)
            h = run_decoder(model, ids[:, :-1], state.num_tokens, ctx, checkpoint_layers)
            hidden = torch.cat([last.to(h.dtype), h], dim=1)
        else:
            hidden = last
        lm_head = unwrap_model(model).get_output_embeddings()
        return token_logprobs(hidden, lm_head, ids, temperature)
