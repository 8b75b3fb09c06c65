"""The prompt-boundary engine: capture a prompt once, replay responses on its read-only state.

How the state reaches the model: the engine calls the model's root forward (so peft, DDP and accelerate
wrappers, LoRA, MoE blocks, norms and HF gradient checkpointing all behave as usual) with a
:class:`ReplayContext` as the ``longstraw`` keyword, which HF passes down to every decoder layer. HF
attention modules forward unknown keywords to their attention interface; the engine wraps every registered
interface so that, when the keyword is present, attention runs over the prompt K/V plus the response's own
causal keys (``kernels.attention``), and otherwise falls through to the original implementation untouched.
Because the context travels as a call argument, a checkpointed layer recomputed during ``backward()`` sees
the same context. The output head is bound per instance so that, inside a LongStraw call, it computes what
the engine asks for (token log-probs, or nothing during capture) instead of full logits.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longstraw_trl.kernels.attention import pages_attention, prompt_response_attention, window_attention
from longstraw_trl.kernels.logprob import token_logprobs
from longstraw_trl.model_patches import find_patch, patch_model, unwrap_model

from .errors import LongStrawError, PromptTooLongError
from .state import KVGrad, KVPages, LayerState, PromptState, WindowKV, _storage_device

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
        # the variant keywords of HF's attention interface, exactly as the stock attention receives them
        variant = dict(
            sliding_window=kwargs.get("sliding_window"),
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
        )
        return ctx.attend(module, query, key, value, scale, **variant), None

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
MODES = ("capture", "replay", "decode", "segment")


@dataclass
class ResponseKV:
    """Decode: the G sequences' own K/V of one attention layer, in a buffer sized for the generation."""

    k: torch.Tensor  # [G, Hkv, capacity, D]
    v: torch.Tensor  # [G, Hkv, capacity, Dv]
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, t = self.length, k.shape[2]
        if n + t > self.k.shape[2]:  # past the announced capacity: grow (amortised doubling)
            cap = max(2 * self.k.shape[2], n + t)
            grow = lambda b: torch.cat([b[:, :, :n], b.new_empty(*b.shape[:2], cap - n, b.shape[3])], 2)  # noqa: E731
            self.k, self.v = grow(self.k), grow(self.v)
        self.k[:, :, n : n + t] = k
        self.v[:, :, n : n + t] = v
        self.length = n + t
        return self.k[:, :, : n + t], self.v[:, :, : n + t]

    def write_at(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token's ``k, v [G, Hkv, 1, D]`` at slot ``index`` (a 0-dim device tensor): fixed
        shapes and no host synchronisation, so a decode step can be replayed as a CUDA graph."""
        self.k.index_copy_(2, index.view(1), k)
        self.v.index_copy_(2, index.view(1), v)


class ReplayContext:
    """What a layer needs during one LongStraw call, passed down as the ``longstraw`` keyword.

    Args:
        mode: ``"capture"`` appends each chunk to the state; ``"replay"`` only reads it; ``"decode"``
            also keeps the G sequences' running per-layer state in :attr:`running` (generation).
        state: the prompt state the call reads (and, in capture, writes).
        cp: context-parallel collectives (default: the state's group, or a single rank).
        checkpoint_layers: recompute each decoder layer in backward instead of storing its activations.
        capacity: decode: response tokens to size the per-sequence buffers for.
        reserve_tokens: capture: prompt tokens this call appends, so each layer allocates once.
        step: decode with fixed shapes (CUDA graphs): a 0-dim device tensor counting the tokens each
            sequence has decoded before this call (one token per call). The buffers keep ``capacity``
            slots and attention masks the unfilled ones. ``None``: buffers grow with each call.
        grads: the full gradient (:class:`StateGrads`): the state's tensors are not constants any more;
            attention hands the pages' dK/dV to its buffers and fixed-size states start from its leaves.
        segment: ``"segment"`` mode: the global resident positions ``(start, end)`` of the recomputed
            segment; ``state`` is then the view at ``start`` (:meth:`PromptState.at`), and every layer
            hands what it adds to the state (its K/V, its state after the segment) to :attr:`emitted`
            with the gradient later segments sent to it.

    Attributes:
        running: decode only: layer index -> that layer's state for the G sequences (:class:`ResponseKV`
            for attention, the family's state type for other layers, e.g. a batched ``GDNState``).
        prompt_copies: decode only: layer index -> a device copy of an offloaded layer's prompt tensor that
            every step reads whole (GLM-5's indexer keys), made by the call's first step and kept for the call
            (the state itself stays on the host).
    """

    def __init__(
        self,
        mode: str,
        state: PromptState,
        cp=None,
        checkpoint_layers: bool = False,
        capacity: int = 0,
        reserve_tokens: int = 0,
        step: torch.Tensor | None = None,
        grads: StateGrads | None = None,
        segment: tuple[int, int] | None = None,
    ):
        if mode not in MODES:
            raise LongStrawError(f"unknown LongStraw mode {mode!r}; one of {', '.join(MODES)}")
        if (mode == "segment") != (segment is not None) or (mode == "segment" and grads is None):
            raise LongStrawError("mode 'segment' takes a segment (start, end) and grads, and only it does")
        self.mode = mode
        self.grads, self.segment = grads, segment
        # (tensor, its gradient from later segments) of what a segment added to the state
        self.emitted: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.state = state
        self.cp = cp if cp is not None else _cp_for(state)
        self.checkpoint_layers = checkpoint_layers
        self.capacity = capacity
        self.reserve_tokens = reserve_tokens
        self.step = step
        self.running: dict[int, object] = {}
        self.prompt_copies: dict[int, torch.Tensor] = {}
        # replay: whether the current decoder layer is recomputed in backward, and the page attention its first
        # forward computed, by layer (see `_prompt_part`)
        self.layer_recomputed = False
        self._prompt_parts: dict[int, tuple] = {}
        self._reserved: set[int] = set()

    def layer_state(self, idx: int, state_type: type[LayerState], make: Callable[[], LayerState]):
        """Layer ``idx``'s prompt state (created by ``make`` in the first capture chunk); ``None`` when the
        state holds no tokens (a one-token prompt: every layer starts from its initial state)."""
        layer = self.state.layers.get(idx)
        if layer is None:
            if self.mode != "capture":
                if self.state.resident_tokens == 0:
                    return None
                raise LongStrawError(
                    f"layer {idx} has no captured {state_type.__name__}: the state belongs to another model"
                )
            layer = self.state.layers[idx] = make()
        if not isinstance(layer, state_type):
            raise LongStrawError(
                f"layer {idx} needs a {state_type.__name__} but the state holds {type(layer).__name__} there: "
                "the state belongs to another model"
            )
        if self.mode == "capture" and idx not in self._reserved:
            layer.reserve(self.reserve_tokens)
            self._reserved.add(idx)
        if self.grads is not None:
            self.grads.check_kind(idx, layer)
            if layer.grad_kind == "leaf":
                leaf = self.grads.leaf(self.state.resident_tokens, idx, layer)
                return layer if leaf is None else leaf
        return layer

    @property
    def state_grad(self) -> bool:
        """Whether fixed-size layer states are differentiable in this call (the full gradient)."""
        return self.grads is not None

    def _emit(self, tensors, grads) -> None:
        for t, g in zip(tensors, grads, strict=True):
            if t is not None and g is not None and t.requires_grad:
                self.emitted.append((t, g.to(t.dtype)))

    def emit_state(self, idx: int, after: LayerState) -> None:
        """A fixed-size layer's state after the segment, paired with the gradient its next user sent."""
        self._emit(after.grad_tensors(), self.grads.carried(self.segment[1], idx))

    def _emit_kv(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start, end = self.segment
        dk, dv = self.grads.kv(idx).take(start, end, k.device)
        if self.cp.size > 1:  # the segment is replicated: every rank needs the dK/dV of every rank's pages
            dk, dv = self.cp.all_reduce_sum(dk), self.cp.all_reduce_sum(dv)
        self._emit([k, v], [dk, dv])

    def _prompt_part(self, idx: int, pages, scale: float, num_kv: int, softcap: float | None):
        """For a replay layer that is recomputed in backward (checkpointed): a function giving its queries' attention
        over the prompt pages, computed in the first forward and handed back to the recompute, which would otherwise
        run the same page attention again (a quarter of a long-prompt replay's attention work). ``None``: compute it
        where it is used. The part is kept from the forward to the recompute (``[B, Hq, T, D]`` fp32 a layer)."""
        if self.mode != "replay" or not self.layer_recomputed or not torch.is_grad_enabled():
            return None

        def part(q: torch.Tensor):
            kept = self._prompt_parts.pop(idx, None)
            if kept is not None and kept[0] == q.shape:
                return kept[1], kept[2]
            out, lse = self.cp.reduce_partial(*pages_attention(q, pages, scale, num_kv, softcap), q)
            self._prompt_parts[idx] = (q.shape, out, lse)
            return out, lse

        return part

    def new_pages(self, k: torch.Tensor, v: torch.Tensor, cls: type[KVPages] = KVPages) -> KVPages:
        """Empty pages for keys like ``k [B, Hkv, T, D]`` and values like ``v``, stored as this call's state
        stores them (device or offload, this rank's pages); ``cls``: a :class:`KVPages` subclass."""
        return cls(
            num_kv_heads=k.shape[1],
            head_dim=k.shape[-1],
            v_head_dim=v.shape[-1],
            page_size=self.state.page_size,
            dtype=k.dtype,
            storage=_storage_device(k.device, self.state.offload),
            cp_rank=self.cp.rank,
            cp_size=self.cp.size,
            offloaded=self.state.offload is not None,
        )

    def attend(
        self,
        module: nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ):
        """``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]`` -> attention output ``[B, T, Hq, D]``.

        The variant is what HF's attention interface receives: ``sliding_window`` (the layer keeps a
        :class:`WindowKV` and attends through a banded mask), ``softcap`` (scores soft-capped before
        the softmax) and ``sinks`` (``s_aux``: a per-head sink logit in the softmax denominator).
        """
        idx = module.layer_idx
        if sliding_window is not None:
            layer = self.layer_state(idx, WindowKV, lambda: WindowKV(sliding_window))
            if layer is not None and layer.window != sliding_window:
                raise LongStrawError(
                    f"layer {idx} has a window of {sliding_window} but its state keeps {layer.window}: "
                    "the state belongs to another model"
                )
        else:
            layer = self.layer_state(idx, KVPages, lambda: self.new_pages(k, v))
        self_length = None
        if self.mode == "decode":
            running = self.running.get(idx)
            if running is None:
                cap = max(self.capacity, k.shape[2])
                running = self.running[idx] = ResponseKV(
                    k.new_zeros(*k.shape[:2], cap, k.shape[3]), v.new_zeros(*v.shape[:2], cap, v.shape[3])
                )
            if self.step is not None:
                running.write_at(self.step, k, v)
                k, v, self_length = running.k, running.v, self.step + 1
            else:
                k, v = running.append(k, v)
        device = q.device

        def pages():
            return layer.stream(device) if layer is not None else iter(())

        if sliding_window is not None:
            # the whole window on every rank: no collective (WindowKV)
            prompt_k, prompt_v = next(iter(pages()), (None, None))
            out = window_attention(
                q, k, v, prompt_k, prompt_v, scale, sliding_window, self_length, softcap=softcap, sinks=sinks
            )
        else:
            page_grads = None
            if self.grads is not None and layer is not None:
                page_grads = self.grads.kv(idx).sink(layer)
            out = prompt_response_attention(
                q,
                k,
                v,
                pages,
                scale,
                reduce_partial=self.cp.reduce_partial,
                reduce_dq=self.cp.reduce_dq,
                self_length=self_length,
                softcap=softcap,
                sinks=sinks,
                page_grads=page_grads,
                prompt_part=self._prompt_part(idx, pages, scale, k.shape[1], softcap),
            )
        if self.mode == "capture":
            layer.append(k[0], v[0])
        elif self.mode == "segment":
            self._emit_kv(idx, k[0], v[0])
        return out.transpose(1, 2)


class _SingleRank:
    rank, size = 0, 1

    @staticmethod
    def reduce_partial(out, lse, q):
        return out, lse

    @staticmethod
    def reduce_dq(dq_pages, dq_self):
        return dq_pages + dq_self

    @staticmethod
    def all_reduce_sum(t):
        return t

    def all_gather(t):
        return [t]


def _cp_for(state: PromptState):
    if state.cp_group is None:
        return _SingleRank()
    from .distributed import ContextParallel

    return ContextParallel(state.cp_group)


# ----------------------------------------------------------------------------------------------------
# Entering the model through its root forward
# ----------------------------------------------------------------------------------------------------
def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# What the output head computes during one LongStraw call (set by the engine around the root forward).
# ``None``: the stock head (logits). Otherwise a callable ``(stock_head, hidden) -> result``.
_HEAD_REQUEST: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "longstraw_head", default=None
)


def _head_forward(self, hidden_states):
    """The output head's forward, bound per instance: the stock head unless the engine asked for more."""
    stock = self._longstraw_stock_forward or type(self).forward.__get__(self)
    request = _HEAD_REQUEST.get()
    if request is None:
        return stock(hidden_states)
    token = _HEAD_REQUEST.set(None)  # a head wrapped inside this one (peft) runs stock
    try:
        return request(stock, hidden_states)
    finally:
        _HEAD_REQUEST.reset(token)


def _install_head(base: nn.Module) -> None:
    head = base.get_output_embeddings()
    if getattr(head, "_longstraw_head", False):
        return
    head._longstraw_stock_forward = head.__dict__.get("forward")  # an accelerate hook, if one is installed
    head.forward = _head_forward.__get__(head)
    head._longstraw_head = True


def _layer_forward(self, *args, **kwargs):
    """A decoder layer's forward, bound per instance: checkpointed when the call asks for it."""
    stock = type(self).forward.__get__(self)
    ctx = kwargs.get(CTX_KWARG)
    hf_checkpoints = getattr(self, "gradient_checkpointing", False) and self.training
    ours = ctx is not None and ctx.checkpoint_layers and torch.is_grad_enabled() and not hf_checkpoints
    if ctx is not None:  # read by the layer's attention (ReplayContext._prompt_part)
        ctx.layer_recomputed = bool(hf_checkpoints or ours)
    if ours:
        return checkpoint(stock, *args, use_reentrant=False, **kwargs)
    return stock(*args, **kwargs)


def install_engine(base: nn.Module, decoder: nn.Module) -> None:
    """What every family needs (idempotent): the attention dispatch, the output head's LongStraw request,
    and per-call layer checkpointing. Methods are bound per instance, so ``deepcopy`` rebinds them."""
    install_attention_dispatch()
    _install_head(base)
    for layer in decoder.layers:
        if not getattr(layer, "_longstraw_layer", False):
            layer.forward = _layer_forward.__get__(layer)
            layer._longstraw_layer = True


def _skip_head(stock, hidden):
    return hidden.new_empty(*hidden.shape[:-1], 0)  # capture needs no logits


class _TokenLogprobs:
    """Head request: log-probs of ``targets`` (chunked, checkpointed under autograd), not logits; with
    ``with_entropy`` a pair (log-probs, entropies) from the same logits, the entropies differentiable only with
    ``entropy_grad``.

    ``logits_transform`` is the family's post-processing of the head's logits (``FamilyPatch.
    logits_transform``: a final soft-cap, a logit scale), applied here as the stock model applies it
    after its head. The result is kept in :attr:`result`; the model gets an empty view of it as its
    ``logits`` (still in the autograd graph), so the model's own post-processing runs on nothing.
    """

    def __init__(
        self,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ):
        self.targets, self.temperature = targets, temperature
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad
        self.logits_transform: Callable | None = None
        self.result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, stock, hidden):
        self.result = token_logprobs(
            hidden,
            stock,
            self.targets,
            self.temperature,
            self.with_entropy,
            entropy_grad=self.entropy_grad,
            logits_transform=self.logits_transform,
        )
        first = self.result[0] if self.with_entropy else self.result
        return first.unsqueeze(-1)[..., :0]


def forward_model(
    model: nn.Module,
    input_ids: torch.Tensor,
    start: int | torch.Tensor,
    ctx: ReplayContext,
    head: Callable | None = None,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """Run ``input_ids [B, T]`` at positions ``start...`` (an int, or a 0-dim device tensor for fixed-shape
    decoding) through the model's root forward (its wrappers included: peft, DDP) with ``ctx`` passed
    down. Returns what the output head computed under ``head`` (``None``: logits of the last
    ``logits_to_keep`` positions, 0 = all)."""
    base = unwrap_model(model)
    patch = find_patch(base)
    _install_head(base)  # peft may have wrapped the head since patch_model
    b, t = input_ids.shape
    position_ids = patch.position_ids(start, t, b, input_ids.device)
    if isinstance(head, _TokenLogprobs):
        head.logits_transform = patch.logits_transform(base)
    token = _HEAD_REQUEST.set(head)
    try:
        out = model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=patch.no_attention_masks(base),
            use_cache=False,
            logits_to_keep=logits_to_keep,
            **{CTX_KWARG: ctx},
        )
    finally:
        _HEAD_REQUEST.reset(token)
    if isinstance(head, _TokenLogprobs):
        return head.result
    return out.logits if hasattr(out, "logits") else out[0]


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
    if bool(((ids < 0) | (ids >= vocab)).any()):  # one host sync per call; the details only on error
        lo, hi = int(ids.min()), int(ids.max())
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
def _prefill(
    state: PromptState,
    model: nn.Module,
    ids: torch.Tensor,
    start: int,
    chunk_size: int,
    progress,
    keep_boundaries: bool = False,
) -> None:
    """Append ``ids`` (1-D) at positions ``start...`` to the layer states of ``state``; with
    ``keep_boundaries`` also keep the fixed-size layers' states at every chunk boundary (the full gradient)."""
    if ids.numel() == 0:
        return
    device = state.device
    ctx = ReplayContext("capture", state, reserve_tokens=ids.numel())
    clock = _ChunkClock(device)
    with _progress(ids.numel(), progress, "capture") as bar:
        for s in range(0, ids.numel(), chunk_size):
            if keep_boundaries and start + s > 0:
                state.keep_boundary(start + s)
            chunk = ids[s : s + chunk_size].to(device)[None]
            forward_model(model, chunk, start + s, ctx, head=_skip_head, logits_to_keep=1)
            clock.tick()
            bar.update(chunk.shape[1])
    state.chunk_seconds = clock.seconds()


class _ChunkClock:
    """Seconds of each prefill chunk: CUDA events recorded on the stream between chunks (read once at the end,
    so the loop never waits on the device), wall-clock time elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._mark()]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def tick(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in itertools.pairwise(self.marks)]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]


def capture_prompt(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    chunk_size: int | None = None,
    page_size: int | None = None,
    offload: str | None = None,
    cp_group=None,
    progress: bool | None = None,
    keep_boundaries: bool = False,
) -> PromptState:
    """Capture ``prompt_ids`` (1-D) once, without autograd, into a :class:`PromptState`.

    The layer states hold the first ``P - 1`` tokens; the last one is kept as an id and runs with every
    replay, so completion token 0 is scored through the whole network (docs/design.md, "Objective").

    Args:
        model: a supported causal LM (patched on the fly; peft-wrapped is fine).
        prompt_ids: 1-D LongTensor, the whole prompt.
        chunk_size: prompt tokens per prefill step (default 8192). Peak memory apart from the state
            grows with the chunk, never with the prompt.
        page_size: tokens per K/V page (default 16384): the unit of context-parallel ownership and of
            offload streaming. Resident K/V is stored contiguously whatever the page size.
        offload: ``None`` keeps K/V on the model's device; ``"cpu"`` keeps it in pinned host memory and
            streams it to the device a page at a time.
        cp_group: a ``torch.distributed`` group: pages are spread round-robin over its ranks.
        progress: show a progress bar (default: only for prompts of 128K tokens or more).
        keep_boundaries: keep what :func:`prompt_backward` needs (the full gradient): the prompt's token
            ids and, at every chunk boundary, the fixed-size layers' states (GDN: conv + recurrent state,
            the state's fixed-size bytes once per chunk boundary, on the model's device).
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
    device = model_device(model)
    _storage_device(device, offload)  # validates `offload`
    state = PromptState({}, device, offload, cp_group, page_size, chunk_size)
    _prefill(state, model, prompt_ids[:-1], 0, chunk_size, progress, keep_boundaries)
    state.num_tokens = prompt_ids.numel()
    state.last_token = prompt_ids[-1].to(device)
    if keep_boundaries:
        state.token_ids = prompt_ids[:-1].detach().cpu().clone()
        state.boundaries = state.boundaries or {}
    return state


def extend_state(
    state: PromptState, model: nn.Module, more_ids: torch.Tensor, progress: bool | None = None
) -> PromptState:
    """A new state for prompt + ``more_ids``; it shares ``state``'s K/V, and ``state`` is unchanged."""
    state.check_not_empty()
    check_token_ids(more_ids, model, "more_ids")
    if more_ids.dim() != 1:
        raise LongStrawError(f"more_ids must be 1-D, got shape {tuple(more_ids.shape)}")
    check_positions(model, state.num_tokens + more_ids.numel(), "the extended prompt")
    new = state.fork()
    ids = torch.cat([state.last_token.view(1).cpu(), more_ids[:-1].cpu()])
    keep = state.token_ids is not None  # the full gradient: the extension keeps what prompt_backward needs
    _prefill(new, model, ids, state.resident_tokens, new.chunk_size or DEFAULT_CHUNK_SIZE, progress, keep)
    new.num_tokens = state.num_tokens + more_ids.numel()
    new.last_token = more_ids[-1].to(state.device)
    if keep:
        new.token_ids = torch.cat([state.token_ids, ids])
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
    return_entropy: bool = False,
    entropy_grad: bool = False,
    grads: StateGrads | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[G, R]`` log-probs of ``completion_ids`` continuing the captured prompt (fp32); with
    ``return_entropy`` also ``[G, R]`` entropies of the same distributions (without gradient unless
    ``entropy_grad``: with ``grad=True`` too, they then carry the graph like the log-probs, for an entropy bonus).

    The model runs ``[last prompt token, completion[:-1]]`` (R positions) on the read-only state; the
    log-prob of completion token ``j`` is read at position ``j``. Positions past a row's mask are computed
    but meaningless (right padding cannot affect earlier tokens under causal attention). With
    ``grad=True`` the result carries the autograd graph of these rows only; ``checkpoint_layers``
    recomputes each decoder layer in backward instead of storing it. ``grads`` (the full gradient, with
    ``grad=True``): backward also accumulates the gradient of the prompt state into it, for
    :func:`prompt_backward` to carry into the prompt's tokens.
    """
    state.check_not_empty()
    if grads is not None and grads.state is not state:
        raise LongStrawError("grads belong to another prompt state: make them with StateGrads(state)")
    if completion_ids.dim() == 1:
        completion_ids = completion_ids[None]
    check_token_ids(completion_ids, model, "completion_ids")
    if completion_mask is not None:
        check_completion_mask(completion_mask, completion_ids)
    g, r = completion_ids.shape
    check_positions(model, state.num_tokens + r, f"prompt ({state.num_tokens}) + completion ({r})")
    ids = completion_ids.to(state.device)
    inputs = torch.cat([state.last_token.view(1, 1).expand(g, 1), ids[:, :-1]], dim=1)
    with torch.set_grad_enabled(grad):
        ctx = ReplayContext(
            "replay", state, checkpoint_layers=checkpoint_layers, grads=grads if grad else None
        )
        head = _TokenLogprobs(ids, temperature, return_entropy, entropy_grad)
        out = forward_model(model, inputs, state.resident_tokens, ctx, head=head)
    return out


# ----------------------------------------------------------------------------------------------------
# The full gradient: segments recomputed in reverse under autograd
# ----------------------------------------------------------------------------------------------------
class StateGrads:
    """The gradient of a loss with respect to a :class:`PromptState`'s resident tensors, accumulated by the
    calls that read the state under autograd and carried back by :func:`prompt_backward`.

    One mechanism for every segment of a sequence (the prompt's capture chunks, a response's blocks): a
    segment is recomputed under autograd from the state at its start, where

    - growing layer states (``grad_kind == "buffer"``, K/V pages) are constants whose gradient the attention
      backward accumulates into a buffer of the state's size (:class:`~longstraw_trl.state.KVGrad`, fp32);
      the segment that produced those tokens takes it back as the gradient of its own K/V;
    - fixed-size layer states (``grad_kind == "leaf"``, GDN conv + recurrent state) at each boundary are a
      leaf (one per boundary, shared by every call starting there, so the gradients of all of them add up);
      the segment ending at that boundary takes the leaf's gradient as that of the state it produced.

    ``parent`` / ``base_tokens``: the grads of a state forked from ``parent.state`` after its
    ``base_tokens`` resident tokens (a response's reverse block replay): what lies before goes to
    ``parent`` (``None``: constants, the response-only gradient).

    Attributes:
        state: the state whose gradient this is.
    """

    def __init__(self, state: PromptState, parent: StateGrads | None = None, base_tokens: int = 0):
        self.state, self.parent, self.base_tokens = state, parent, base_tokens
        self.base_state: PromptState | None = None
        self._kv: dict[int, KVGrad] = {}
        self._leaves: dict[tuple[int, int], LayerState] = {}

    @classmethod
    def for_fork(cls, fork: PromptState, base: PromptState, parent: StateGrads | None) -> StateGrads:
        """Grads of ``fork`` (``base.fork()``, then extended): ``base``'s part goes to ``parent``."""
        grads = cls(fork, parent, base.resident_tokens)
        grads.base_state = base
        return grads

    def check_kind(self, idx: int, layer: LayerState) -> None:
        if layer.grad_kind is None:
            raise LongStrawError(
                f"layer {idx} keeps a {type(layer).__name__}, which has no full gradient (gradient_mode='full' "
                "and reverse block replay support K/V pages and Gated DeltaNet states)"
            )

    def kv(self, idx: int) -> KVGrad:
        """The dK/dV buffers of layer ``idx`` (K/V pages)."""
        if idx not in self._kv:
            layer = self.state.layers[idx]
            shared, parent = 0, None
            if self.base_state is not None and idx in self.base_state.layers:
                shared = len(self.base_state.layers[idx].segments)
                parent = self.parent.kv(idx) if self.parent is not None else None
            self._kv[idx] = KVGrad(layer, shared, parent)
        return self._kv[idx]

    def leaf(self, tokens: int, idx: int, layer: LayerState) -> LayerState | None:
        """The leaf standing for layer ``idx``'s state ``layer`` after ``tokens`` resident tokens (``None``:
        a constant, when that boundary belongs to no gradient)."""
        if tokens <= self.base_tokens and self.base_state is not None:
            return None if self.parent is None else self.parent.leaf(tokens, idx, layer)
        key = (tokens, idx)
        if key not in self._leaves:
            tensors = [None if t is None else t.detach().requires_grad_() for t in layer.grad_tensors()]
            self._leaves[key] = layer.with_tensors(tensors)
        return self._leaves[key]

    def carried(self, tokens: int, idx: int) -> list[torch.Tensor | None]:
        """The gradient the calls starting after ``tokens`` resident tokens sent to layer ``idx``'s state."""
        if tokens <= self.base_tokens and self.base_state is not None:
            return [None, None] if self.parent is None else self.parent.carried(tokens, idx)
        leaf = self._leaves.get((tokens, idx))
        if leaf is None:
            return [None] * len(self.state.layers[idx].grad_tensors())
        return [None if t is None else t.grad for t in leaf.grad_tensors()]

    def nbytes(self) -> int:
        """Bytes of the gradient buffers and leaves held now."""
        kv = sum(g.nbytes() for g in self._kv.values())
        leaves = sum(
            t.numel() * t.element_size()
            for leaf in self._leaves.values()
            for t in leaf.grad_tensors()
            if t is not None and t.grad is not None
        )
        return kv + leaves


@contextlib.contextmanager
def _hf_checkpointing_off(modules: list[nn.Module]):
    for m in modules:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in modules:
            m.gradient_checkpointing = True


def backward_segment(
    model: nn.Module,
    state: PromptState,
    grads: StateGrads,
    ids: torch.Tensor,
    start: int,
    head: Callable | None = None,
    loss: Callable[[object], torch.Tensor] | None = None,
    checkpoint_layers: bool = False,
):
    """Recompute the segment ``ids [1, T]`` at resident positions ``start ... start + T`` of ``state`` under
    autograd and back-propagate into the parameters: the gradient later segments sent to what it added to
    the state (``grads``), plus ``loss(head result)`` when a loss is given (a response block's own tokens).

    The segment reads the state at ``start`` (its earlier tokens' K/V are constants whose dK/dV go to
    ``grads``; the fixed-size states there are leaves of ``grads``). Returns the head's result.
    """
    end = start + ids.shape[1]
    view = state.at(start)
    # HF's checkpointing may be reentrant, which runs the layer without a graph and would cut the K/V and states the
    # segment hands out: the engine's own (non-reentrant) layer checkpointing replaces it here
    hf = [m for m in unwrap_model(model).modules() if getattr(m, "gradient_checkpointing", False) is True]
    checkpoint_layers = checkpoint_layers or (bool(hf) and model.training)
    with torch.enable_grad(), _hf_checkpointing_off(hf):
        ctx = ReplayContext(
            "segment", view, checkpoint_layers=checkpoint_layers, grads=grads, segment=(start, end)
        )
        keep = 1 if head is None else 0  # a prompt chunk needs no logits
        out = forward_model(model, ids, start, ctx, head=head or _skip_head, logits_to_keep=keep)
        tensors = [t for t, _ in ctx.emitted]
        grad_tensors = [g for _, g in ctx.emitted]
        if loss is not None:
            tensors.append(loss(out))
            grad_tensors.append(None)
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
    return out


def prompt_backward(
    state: PromptState,
    model: nn.Module,
    grads: StateGrads,
    checkpoint_layers: bool = False,
    progress: bool | None = None,
    no_sync: Callable | None = None,
    sync_last: bool = False,
) -> None:
    """Carry the gradient the replays accumulated in ``grads`` into the prompt's tokens: the capture chunks are
    recomputed under autograd in reverse order, each receiving the gradient that later chunks and every
    response sent to its K/V and state, and passing its own on. Adds to the parameters' ``.grad``: after the
    replays' backward, the parameter gradient is the full-sequence one (docs/design.md, "The full gradient").

    Needs a state captured with ``keep_boundaries=True`` (same chunks); extra memory: one chunk's graph
    (``checkpoint_layers`` recomputes each layer in backward) and the chunk's GDN leaves' gradients.
    Context parallelism: every rank runs every chunk; the chunk's dK/dV are all-reduced before it runs.
    ``no_sync`` (DDP): a context factory the chunks' backward runs under, except, with ``sync_last``, the last
    one's (the first chunk), which then also scores its tokens with a zero weight, so that every parameter
    (the output head too) takes part in the synchronising backward.
    """
    if grads.state is not state:
        raise LongStrawError("grads belong to another prompt state: make them with StateGrads(state)")
    if state.token_ids is None:
        raise LongStrawError(
            "prompt_backward needs a state captured with keep_boundaries=True (the prompt's ids and the "
            "GDN states at its chunk boundaries)"
        )
    n = state.resident_tokens
    # the segments are the capture's chunks (an extension's too): one starts at every kept boundary
    starts = [0] + sorted(t for t in state.boundaries or {} if 0 < t < n)
    ends = starts[1:] + [n]
    with _progress(n, progress, "prompt backward") as bar:
        for s, e in reversed(list(zip(starts, ends, strict=True))):
            ids = state.token_ids[s:e].to(state.device)[None]
            head = loss = None
            if sync_last and s == 0:
                head, loss = _TokenLogprobs(ids, 1.0), (lambda out: out.sum() * 0.0)
            sync = (
                no_sync() if no_sync is not None and not (sync_last and s == 0) else contextlib.nullcontext()
            )
            with sync:
                backward_segment(model, state, grads, ids, s, head, loss, checkpoint_layers)
            bar.update(ids.shape[1])


def replay_blocks_backward(
    state: PromptState,
    model: nn.Module,
    completion_ids: torch.Tensor,
    block_size: int,
    loss: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    temperature: float = 1.0,
    grads: StateGrads | None = None,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    checkpoint_layers: bool = False,
    no_sync: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reverse block replay of one response: the gradient of ``loss(logps, entropies)`` (``[R]`` each) with
    peak memory of one block's graph plus the response's own state, whatever R.

    The response (``completion_ids [1, R]`` or ``[R]``) runs in blocks of ``block_size`` positions: forward without
    autograd block by block on a fork of ``state`` that keeps the state at each block boundary (the
    response's K/V so far, the GDN states there), then the blocks are recomputed under autograd in reverse
    order (:func:`backward_segment`): each back-propagates ``loss`` through its own log-probs (the others held
    at their values, so the gradients of the blocks sum to the whole response's) plus the gradient later
    blocks sent to its K/V and state. ``grads`` (the full gradient): what reaches the prompt state goes there,
    as a whole replay with ``grads`` would send it; ``None``: the prompt state is a constant. ``no_sync``: a
    context factory every backward but the last runs under (DDP). Returns the detached ``[R]`` log-probs,
    entropies (``None`` unless ``return_entropy``) and the loss value.
    """
    state.check_not_empty()
    if completion_ids.dim() == 1:
        completion_ids = completion_ids[None]
    if completion_ids.shape[0] != 1:
        raise LongStrawError(
            f"reverse block replay takes one response at a time, got {completion_ids.shape[0]}"
        )
    if block_size <= 0:
        raise LongStrawError(f"block_size must be positive, got {block_size}")
    if grads is not None and grads.state is not state:
        raise LongStrawError("grads belong to another prompt state: make them with StateGrads(state)")
    check_token_ids(completion_ids, model, "completion_ids")
    r = completion_ids.shape[1]
    check_positions(model, state.num_tokens + r, f"prompt ({state.num_tokens}) + completion ({r})")
    ids = completion_ids.to(state.device)
    inputs = torch.cat([state.last_token.view(1, 1), ids[:, :-1]], dim=1)
    base = state.resident_tokens
    starts = list(range(0, r, block_size))
    with_entropy = return_entropy or entropy_grad

    # forward without autograd: every block but the last appended to a fork, the state kept at each boundary
    fork = state.fork()
    logps, entropies = ids.new_zeros(r, dtype=torch.float32), ids.new_zeros(r, dtype=torch.float32)
    ctx = ReplayContext("capture", fork, reserve_tokens=starts[-1])
    with torch.no_grad():
        for s in starts[:-1]:
            e = min(r, s + block_size)
            fork.keep_boundary(base + s)
            head = _TokenLogprobs(ids[:, s:e], temperature, with_entropy)
            out = forward_model(model, inputs[:, s:e], base + s, ctx, head=head)
            lp, h = out if with_entropy else (out, None)
            logps[s:e] = lp[0].float()
            if h is not None:
                entropies[s:e] = h[0].float()
    fork.num_tokens = state.num_tokens + starts[-1]
    block_grads = StateGrads.for_fork(fork, state, grads)

    value = None
    for n, s in enumerate(reversed(starts)):
        e = min(r, s + block_size)
        head = _TokenLogprobs(ids[:, s:e], temperature, with_entropy, entropy_grad)

        def block_loss(out, s=s, e=e):
            nonlocal value
            lp, h = out if with_entropy else (out, None)
            full_lp = torch.cat([logps[:s], lp[0], logps[e:]])
            full_h = torch.cat([entropies[:s], h[0], entropies[e:]]) if h is not None else None
            term = loss(full_lp, full_h)
            value = term.detach() if value is None else value
            return term

        last = n == len(starts) - 1
        sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
        with sync:
            out = backward_segment(
                model, fork, block_grads, inputs[:, s:e], base + s, head, block_loss, checkpoint_layers
            )
        lp, h = out if with_entropy else (out, None)
        logps[s:e] = lp[0].detach().float()
        if h is not None:
            entropies[s:e] = h[0].detach().float()
    return logps, (entropies if return_entropy else None), value
