"""What a layer sees during one LongStraw call: the :class:`ForwardContext`, passed down the decoder layers as the
``longstraw`` keyword, and its :class:`Mode`.

The context owns what each mode reads and writes: family patches ask it for a layer's prompt state
(:meth:`ForwardContext.layer_state`), hand it what their layer produced (:meth:`ForwardContext.keep_kv`,
:meth:`ForwardContext.keep_final_state`) and read the decode buffers from it (:meth:`ForwardContext.response_kv`);
they never switch on the mode themselves.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from longstraw_trl.kernels.attention import pages_attention, prompt_response_attention, window_attention

from .context_parallel import communicator
from .errors import LongStrawError
from .host_memory import storage_device
from .layer_state import ConvRecurrentState, KVPages, LayerState, WindowKV, owned_tokens
from .prompt_state import PromptState
from .state_grads import StateGrads

CTX_KWARG = "longstraw"


def _unbatched(x: torch.Tensor) -> torch.Tensor:
    """``x [1, ...]`` without its batch dimension, for what a segment emits under autograd: ``squeeze``'s backward is
    a view, where ``x[0]``'s writes the gradient into zeros of ``x``'s shape (two kernels a tensor and layer)."""
    return x.squeeze(0)


class Mode(enum.Enum):
    """What one LongStraw call does with the prompt state.

    - ``CAPTURE``: append the call's tokens to the state (prefill, extension, a block replay's forward);
    - ``REPLAY``: only read it (log-probs, the loss's replays);
    - ``DECODE``: read it, and keep the G sequences' own per-layer state from step to step (generation);
    - ``SEGMENT``: recompute a stretch of the state under autograd (the full gradient), handing what it adds to the
      state to the gradient that later segments sent to it.
    """

    CAPTURE = "capture"
    REPLAY = "replay"
    DECODE = "decode"
    SEGMENT = "segment"

    @property
    def appends(self) -> bool:
        """Whether the call's tokens are appended to the prompt state."""
        return self is Mode.CAPTURE

    @property
    def keeps_running_state(self) -> bool:
        """Whether the sequences' own per-layer state outlives the call (decode buffers, GDN running state)."""
        return self is Mode.DECODE

    @property
    def needs_final_state(self) -> bool:
        """Whether fixed-size layers (GDN) must output their state after the call's tokens."""
        return self is not Mode.REPLAY

    @property
    def host_sync_ok(self) -> bool:
        """Whether a layer may read a tensor's values on the host (a capture chunk: many queries, never inside a
        decode step's CUDA graph or a replay under autograd)."""
        return self is Mode.CAPTURE

    @property
    def creates_layer_states(self) -> bool:
        """Whether a layer without a prompt state gets one (the first capture chunk)."""
        return self is Mode.CAPTURE


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


class ForwardContext:
    """What a layer needs during one LongStraw call, passed down as the ``longstraw`` keyword.

    Args:
        mode: a :class:`Mode` (or its value, e.g. ``"replay"``).
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
        mode: Mode | str,
        state: PromptState,
        cp=None,
        checkpoint_layers: bool = False,
        capacity: int = 0,
        reserve_tokens: int = 0,
        step: torch.Tensor | None = None,
        grads: StateGrads | None = None,
        segment: tuple[int, int] | None = None,
    ):
        try:
            mode = Mode(mode)
        except ValueError:
            raise LongStrawError(
                f"unknown LongStraw mode {mode!r}; one of {', '.join(m.value for m in Mode)}"
            ) from None
        if (mode is Mode.SEGMENT) != (segment is not None) or (mode is Mode.SEGMENT and grads is None):
            raise LongStrawError("mode 'segment' takes a segment (start, end) and grads, and only it does")
        self.mode = mode
        self.grads, self.segment = grads, segment
        # (tensor, its gradient from later segments) of what a segment added to the state
        self.emitted: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._emitted_layers: set[int] = set()
        self.state = state
        self.cp = cp if cp is not None else communicator(state.cp_group)
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
            if not self.mode.creates_layer_states:
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
        if self.mode.appends and idx not in self._reserved:
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

    def _first_emission(self, idx: int) -> bool:
        """Whether layer ``idx`` emits for the first time in this call. A checkpointed layer runs again when backward
        recomputes it: what it emits then must not be kept (it would hold the recomputed layer's activations until
        the segment's backward ends: every layer's, 72 GiB more for a 16K-token chunk of the whole Qwen3.6-27B)."""
        if idx in self._emitted_layers:
            return False
        self._emitted_layers.add(idx)
        return True

    def emit_state(self, idx: int, after: LayerState) -> None:
        """A fixed-size layer's state after the segment, paired with the gradient its next user sent."""
        if self._first_emission(idx):
            self._emit(after.grad_tensors(), self.grads.carried(self.segment[1], idx))

    def _emit_kv(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self._first_emission(idx):
            return
        start, end = self.segment
        dk, dv = self.grads.kv(idx).take(start, end, k.device)
        if self.cp.size > 1:  # the segment is replicated: every rank needs the dK/dV of every rank's pages
            dk, dv = self.cp.all_reduce_sum(dk), self.cp.all_reduce_sum(dv)
        self._emit([k, v], [dk, dv])

    def _prompt_part(self, idx: int, pages, scale: float, num_kv: int, softcap: float | None):
        """For a replay or prompt-backward segment layer that is recomputed in backward (checkpointed): a function
        giving its queries' attention over the prompt pages, computed in the first forward and handed back to the
        recompute, which would otherwise run the same page attention again (a quarter of a long-prompt replay's
        attention work; in a segment, the quadratic part of the recompute, and with offload a second stream of every
        page from the host). ``None``: compute it where it is used. The part is kept from the forward to the
        recompute (``[B, Hq, T, D]`` fp32 a layer)."""
        if (
            self.mode not in (Mode.REPLAY, Mode.SEGMENT)
            or not self.layer_recomputed
            or not torch.is_grad_enabled()
        ):
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
        stores them (device or offload, this rank's pages; an offloaded state's :attr:`PromptState.device_share`
        keeps whole layers on the device while they fit); ``cls``: a :class:`KVPages` subclass."""
        offloaded = self.state.offload is not None and not self._stays_on_device(k, v, cls)
        return cls(
            num_kv_heads=k.shape[1],
            head_dim=k.shape[-1],
            v_head_dim=v.shape[-1],
            page_size=self.state.page_size,
            dtype=k.dtype,
            storage=storage_device(k.device, self.state.offload if offloaded else None),
            cp_rank=self.cp.rank,
            cp_size=self.cp.size,
            offloaded=offloaded,
        )

    def _stays_on_device(self, k: torch.Tensor, v: torch.Tensor, cls: type[KVPages]) -> bool:
        """Whether an offloaded state's new layer of pages stays on the device: the bytes of the tokens this
        capture appends to it (this rank's pages) fit what is left of the state's device share."""
        share = self.state.device_share
        if share is None:
            return False
        tokens = owned_tokens(0, self.reserve_tokens, self.state.page_size, self.cp.rank, self.cp.size)
        return share.take(tokens * cls.bytes_per_token(k.shape[1], k.shape[-1], v.shape[-1], k.dtype))

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
        k, v, self_length = self.response_kv(idx, k, v)
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
        if sliding_window is not None and self.mode is Mode.SEGMENT:
            # the window after the segment, under autograd: its gradient is what the next segment sent to the window
            self.emit_state(idx, (layer or WindowKV(sliding_window)).extended(_unbatched(k), _unbatched(v)))
        else:
            self.keep_kv(idx, layer, k, v)
        return out.transpose(1, 2)

    # --- what each mode reads and writes (the families call these, never switch on the mode) --------------------
    @property
    def decoding(self) -> bool:
        """A decode step: one token per sequence, the sequences' own state kept in :attr:`running`, no pages
        streamed when the step is a CUDA graph."""
        return self.mode is Mode.DECODE

    def response_kv(self, idx: int, k: torch.Tensor, v: torch.Tensor):
        """The call's own keys and values of layer ``idx`` that its queries attend to, and how many of them are
        filled (``None``: all). Decode: this step's ``k, v [G, H, 1, D]`` written into the sequences' buffers
        (:class:`ResponseKV`, sized for ``capacity`` tokens), which are returned whole with fixed shapes; other
        modes: ``k, v`` themselves."""
        if not self.mode.keeps_running_state:
            return k, v, None
        running = self.running.get(idx)
        if running is None:
            cap = max(self.capacity, k.shape[2])
            running = self.running[idx] = ResponseKV(
                k.new_zeros(*k.shape[:2], cap, k.shape[3]), v.new_zeros(*v.shape[:2], cap, v.shape[3])
            )
        if self.step is not None:
            running.write_at(self.step, k, v)
            return running.k, running.v, self.step + 1
        k, v = running.append(k, v)
        return k, v, None

    def keep_kv(self, idx: int, layer: LayerState | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """What a K/V-growing layer (pages, window, MLA latent) adds to the state: ``k, v [1, H, T, D]`` appended
        (capture), or handed to the gradient later segments sent to them (segment); nothing otherwise."""
        if self.mode is Mode.CAPTURE:
            layer.append(k[0].detach(), v[0].detach())
        elif self.mode is Mode.SEGMENT:
            self._emit_kv(idx, _unbatched(k), _unbatched(v))

    def running_state(self, idx: int) -> LayerState | None:
        """Decode: the sequences' own state of fixed-size layer ``idx`` after the previous steps (``None`` before
        the first step, and in every other mode)."""
        return self.running.get(idx) if self.mode.keeps_running_state else None

    def recurrent_start(self, idx: int, cls: type[ConvRecurrentState], batch: int) -> ConvRecurrentState:
        """The state a recurrent layer (GDN, Mamba-2) of ``batch`` sequences starts this call from, never written (the
        kernels treat it as a constant): decode: the sequences' running state after the previous steps; otherwise the
        prompt state expanded to the batch (in the full gradient: its leaf); the initial state (no tensors) when nothing
        is captured yet."""
        running = self.running_state(idx)
        if running is not None:
            if running.batch != batch:
                raise LongStrawError(
                    f"decode batch changed from {running.batch} to {batch} within one context"
                )
            return running
        prompt = self.layer_state(idx, cls, cls)
        if prompt is None:  # nothing captured yet: the start of the sequence
            return cls()
        return prompt.expand(batch)

    def keep_final_state(self, idx: int, after: LayerState) -> None:
        """A fixed-size layer's state after the call's tokens (only asked for when ``mode.needs_final_state``):
        the prompt state's new value (capture), the sequences' running state (decode; with fixed shapes written
        into the tensors the next step, a replayed CUDA graph, reads), or paired with the gradient the next segment
        sent to it (segment)."""
        if self.mode is Mode.CAPTURE:
            self.state.layers[idx].append(*after.grad_tensors())
        elif self.mode is Mode.DECODE:
            running = self.running.get(idx)
            if self.step is not None and running is not None:
                for dst, src in zip(running.grad_tensors(), after.grad_tensors(), strict=True):
                    if src is not dst:
                        dst.copy_(src)
            else:
                self.running[idx] = after
        elif self.mode is Mode.SEGMENT:
            self.emit_state(idx, after)

    def prompt_copy(self, idx: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A device copy of an offloaded prompt tensor of layer ``idx`` that every decode step reads whole: made by
        a decode call's first step and kept for its later ones (:attr:`prompt_copies`); other modes make it anew."""
        if not self.mode.keeps_running_state:
            return make()
        copy = self.prompt_copies.get(idx)
        if copy is None:
            copy = self.prompt_copies[idx] = make()
        return copy
