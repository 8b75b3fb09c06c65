"""The state of one decoder layer at the prompt boundary: the :class:`LayerState` protocol and the kinds every
family shares.

- full-attention layers: K/V (:class:`KVPages`, grows with P, sharded over context-parallel ranks);
- sliding-window attention layers: the last ``window - 1`` tokens' K/V (:class:`WindowKV`, fixed size);
- recurrent layers (Gated DeltaNet, Mamba-2): a conv history and a recurrent state (:class:`ConvRecurrentState`).

Other layer kinds (an MLA latent, ...) subclass :class:`LayerState` in their family patch
(``FamilyPatch.layer_state_type``): the engine, the planner, context parallelism and offload use the protocol only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import torch

from .errors import LongStrawError
from .host_memory import copy_across_devices, pinned_empty, prefetch_to_device


class LayerState(ABC):
    """The resident state of one decoder layer at the prompt boundary: the protocol of every layer kind.

    Subclasses set :attr:`kind` (the key of ``PromptState.nbytes_by_kind``) and :attr:`sharded` and
    implement the methods below. A state is written only while its prompt is captured (``append``); after
    that it is read-only, and ``fork`` gives a state that can be extended without changing this one.
    """

    #: name of the kind of state (``"kv"``, ``"gdn"``, ...), as reported by ``nbytes_by_kind``.
    kind: ClassVar[str] = ""
    #: True when context-parallel ranks each hold a part (by page); False when every rank holds it all.
    sharded: ClassVar[bool] = False

    @abstractmethod
    def append(self, *parts: torch.Tensor) -> None:
        """Add one capture chunk's contribution (K/V of the chunk, the state after the chunk, ...)."""

    def reserve(self, more_tokens: int) -> None:
        """A capture announces that ``more_tokens`` prompt tokens follow (states that grow with P allocate
        once for all of them; fixed-size states ignore it)."""
        return None

    @abstractmethod
    def fork(self) -> LayerState:
        """A state equal to this one that ``append`` can extend without changing this one."""

    @abstractmethod
    def stream(self, device: torch.device) -> Iterator[tuple[torch.Tensor, ...]]:
        """The state's tensors on ``device``, in the blocks a kernel reads them (streamed when offloaded)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of state held on this rank (allocation slack excluded)."""

    def slack_bytes(self) -> int:
        """Allocated but unused bytes on this rank."""
        return 0

    def decode_streams(self, device: torch.device) -> bool:
        """Whether a decode step on ``device`` copies part of this state from host memory with the host's help
        (offloaded pages streamed through side streams, or indices brought to the host): such a step is not
        captured as a CUDA graph. The default: states held on the device stream nothing."""
        return False

    def nbytes_by_kind(self) -> dict[str, int]:
        """:meth:`nbytes` split by kind of state; a layer that holds several kinds (an MLA latent and
        indexer keys) reports each. The default: all of it under :attr:`kind`."""
        return {self.kind: self.nbytes()}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the state holds (shared ones included), e.g. to count memory once across forks.

        The default walks the instance's attributes: tensors, and tensors inside lists or tuples of them."""
        for value in vars(self).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                parts = item if isinstance(item, tuple) else (item,)
                yield from (t for t in parts if isinstance(t, torch.Tensor))

    @classmethod
    @abstractmethod
    def planned_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        """The planner's formula: bytes this layer holds on a rank that stores ``tokens_on_rank`` tokens.

        Must equal :meth:`nbytes` of a captured state (``tests/test_planner.py`` checks it).
        """

    # --- the full gradient (engine: ``StateGrads``, ``prompt_backward``, reverse block replay) -----------
    #: how the gradient reaches this kind: ``"buffer"`` (states that grow with the tokens, read by later
    #: tokens as constants: their gradient is accumulated into a buffer of the state's size), ``"leaf"``
    #: (fixed-size states rebound at every boundary: the boundary state is a leaf whose gradient is carried
    #: back to the segment that produced it), ``None`` (no full gradient for this kind).
    grad_kind: ClassVar[str | None] = None

    def boundary(self) -> LayerState | None:
        """What to keep at a segment boundary so that :meth:`prefix` can give this state back there
        (``"leaf"`` kinds: a snapshot; ``"buffer"`` kinds: ``None``, their prefix is a view)."""
        return self.fork()

    def prefix(self, tokens: int, kept: LayerState | None) -> LayerState:
        """This state as it was after the first ``tokens`` tokens; ``kept`` is what :meth:`boundary` gave there."""
        if kept is None:
            raise LongStrawError(
                f"no {type(self).__name__} was kept at token {tokens}: capture with keep_boundaries=True"
            )
        return kept

    def grad_tensors(self) -> list[torch.Tensor | None]:
        """``"leaf"`` kinds: the tensors that carry gradient across a boundary."""
        raise LongStrawError(f"{type(self).__name__} has no full gradient")

    def with_tensors(self, tensors: list[torch.Tensor | None]) -> LayerState:
        """``"leaf"`` kinds: the same state with :meth:`grad_tensors` replaced (e.g. by leaves)."""
        raise LongStrawError(f"{type(self).__name__} has no full gradient")

    @classmethod
    def planned_bytes_by_kind(
        cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2
    ) -> dict[str, int]:
        """:meth:`planned_bytes` split as :meth:`nbytes_by_kind` splits :meth:`nbytes`."""
        return {cls.kind: cls.planned_bytes(config, layer_idx, tokens_on_rank, dtype_bytes)}

    # --- offload (``offload_prompt_state="cpu"``; the planner's ``--offload cpu``) ------------------------
    #: whether ``offload_prompt_state="cpu"`` keeps this kind in host memory (False: it stays on the device regardless)
    offloadable: ClassVar[bool] = False

    @classmethod
    def planned_offload_workspace(
        cls, config, layer_idx: int, tokens_on_rank: int, page_size: int, dtype_bytes: int = 2
    ) -> int:
        """The planner's formula: device bytes an offloaded layer of this kind holds while it runs (what it has
        streamed back from the host); one layer runs at a time. The default: none (not offloadable)."""
        return 0


def owned_tokens(start: int, count: int, page_size: int, cp_rank: int = 0, cp_size: int = 1) -> int:
    """Tokens of global positions ``[start, start + count)`` on pages ``j`` with ``j % cp_size == cp_rank``."""
    if cp_size == 1:
        return count
    total, pos, end = 0, start, start + count
    while pos < end:
        page, offset = divmod(pos, page_size)
        n = min(page_size - offset, end - pos)
        if page % cp_size == cp_rank:
            total += n
        pos += n
    return total


class KVPages(LayerState):
    """K/V of one full-attention layer.

    Ownership is by page: with context parallelism, global page ``j`` (tokens ``j * page_size ...``)
    belongs to rank ``j % cp_size``, and only owned tokens are stored. Storage is by segment: a segment is
    one contiguous ``[num_kv_heads, capacity, head_dim]`` buffer per K and V, filled in arrival order, so
    a whole captured prompt is one segment and attention reads it in one kernel call (keys need no order:
    prompt keys are unmasked). A capture reserves the segment for the whole prompt (:meth:`reserve`), so
    nothing is allocated twice and no slack is left. Segments are never copied: ``fork`` shares them and
    the fork writes later tokens into a new segment (copy-on-write without the copy).
    ``num_tokens`` counts the tokens of the whole prompt (all ranks). ``offloaded``: the segments live in
    host memory (``storage``) and are streamed to the compute device a page at a time.
    """

    kind = "kv"
    sharded = True

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        storage: torch.device,
        cp_rank: int = 0,
        cp_size: int = 1,
        offloaded: bool = False,
    ):
        self.num_kv_heads, self.head_dim, self.v_head_dim = num_kv_heads, head_dim, v_head_dim
        self.offloaded = offloaded
        self.page_size, self.dtype, self.storage = page_size, dtype, storage
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.num_tokens = 0
        # (k [Hkv, capacity, D], v [Hkv, capacity, Dv], filled): shared with forks, never written below `filled`
        self.segments: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._writable_tail = False  # may the last segment take more tokens (False when shared by a fork)
        self._reserved = 0  # owned tokens announced by `reserve` and not yet appended
        # offloaded: recorded on the compute stream after the last device-to-host write into the segments; the
        # side stream that streams them back waits for it (`prefetch_to_device`)
        self._host_written: torch.cuda.Event | None = None

    def owns(self, page_index: int) -> bool:
        return page_index % self.cp_size == self.cp_rank

    def reserve(self, more_tokens: int) -> None:
        """Announce that ``more_tokens`` prompt tokens follow, so one segment is allocated for them all."""
        self._reserved = owned_tokens(
            self.num_tokens, more_tokens, self.page_size, self.cp_rank, self.cp_size
        )

    def _new_segment(self, at_least: int) -> None:
        capacity = max(at_least, self._reserved, 1) if self._reserved else max(at_least, self.page_size)
        # pinned from the start (pinning a pageable buffer copies it) and of exactly its size (pinned_empty)
        k_shape = (self.num_kv_heads, capacity, self.head_dim)
        v_shape = (self.num_kv_heads, capacity, self.v_head_dim)
        if self.storage.type == "cpu" and torch.cuda.is_available():
            k, v = pinned_empty(k_shape, self.dtype), pinned_empty(v_shape, self.dtype)
        else:
            k = torch.empty(k_shape, dtype=self.dtype, device=self.storage)
            v = torch.empty(v_shape, dtype=self.dtype, device=self.storage)
        self.segments.append((k, v, 0))
        self._writable_tail = True

    @torch.no_grad()
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k [Hkv, T, D]``, ``v [Hkv, T, Dv]`` after the last token (only owned pages are kept)."""
        t, pos = k.shape[1], 0
        while pos < t:
            page, offset = divmod(self.num_tokens, self.page_size)
            n = min(self.page_size - offset, t - pos) if self.cp_size > 1 else t - pos
            if self.owns(page):
                self._write(k[:, pos : pos + n], v[:, pos : pos + n])
            self.num_tokens += n
            pos += n

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        if not self._writable_tail or self.segments[-1][2] + n > self.segments[-1][0].shape[1]:
            room = self.segments[-1][0].shape[1] - self.segments[-1][2] if self._writable_tail else 0
            if room:  # fill what is left, then continue in a new segment
                self._write(k[:, :room], v[:, :room])
                k, v, n = k[:, room:], v[:, room:], n - room
            self._new_segment(n)
        kb, vb, filled = self.segments[-1]
        copy_across_devices(kb[:, filled : filled + n], k)
        copy_across_devices(vb[:, filled : filled + n], v)
        if k.is_cuda and kb.device.type == "cpu":
            self._host_written = torch.cuda.current_stream(k.device).record_event()
        self.segments[-1] = (kb, vb, filled + n)
        self._reserved = max(0, self._reserved - n)

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """``(segment, start, end)`` of each block :meth:`stream` yields, in its order (stored indices)."""
        for j, (_, _, filled) in enumerate(self.segments):
            step = self.page_size if self.offloaded else max(filled, 1)
            for s in range(0, filled, step):
                yield j, s, min(filled, s + step)

    def stream(
        self, device: torch.device, keys: bool = True, values: bool = True
    ) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Yield ``(k, v)`` blocks on ``device``: each resident segment whole (one kernel call each);
        offloaded segments in ``page_size`` pieces, the next piece's copy overlapping the current one's
        compute (:func:`prefetch_to_device`), so the device holds two pieces at a time. The blocks are
        those of :meth:`blocks`, in its order. ``keys=False`` / ``values=False``: that half is not copied
        (``None`` in its place)."""
        pieces = (
            (
                self.segments[j][0][:, s:e] if keys else None,
                self.segments[j][1][:, s:e] if values else None,
            )
            for j, s, e in self.blocks()
        )
        if not self.offloaded:
            yield from pieces
            return
        yield from prefetch_to_device(pieces, device, after=self._host_written)

    grad_kind = "buffer"
    #: the full gradient: whether the values get a gradient buffer (False: a family whose "values" never take a
    #: gradient, GLM-5's indexer keys, spares the buffer)
    grad_values: ClassVar[bool] = True

    @classmethod
    def planned_grad_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        """The planner's formula: bytes of this layer's fp32 gradient buffers (:class:`KVGrad`) on a rank that stores
        ``tokens_on_rank`` tokens."""
        return cls.planned_bytes(config, layer_idx, tokens_on_rank, dtype_bytes) * 4 // dtype_bytes

    def boundary(self) -> None:
        return None  # the prefix is a view of the segments

    def prefix(self, tokens: int, kept: LayerState | None = None) -> KVPages:
        """A read-only view of the first ``tokens`` tokens (all ranks; this rank keeps its owned ones)."""
        if tokens > self.num_tokens:
            raise LongStrawError(f"prefix of {tokens} tokens asked of a KVPages of {self.num_tokens}")
        left = owned_tokens(0, tokens, self.page_size, self.cp_rank, self.cp_size)
        view = self._empty_like()
        view.num_tokens = tokens
        view._host_written = self._host_written
        for kb, vb, filled in self.segments:
            if left <= 0:
                break
            view.segments.append((kb, vb, min(filled, left)))
            left -= filled
        return view

    def stored_index(self, position: int) -> int:
        """Stored index of the owned global token ``position`` (tokens arrive in position order)."""
        return owned_tokens(0, position, self.page_size, self.cp_rank, self.cp_size)

    def token_bytes(self) -> int:
        """Bytes of one token's K and V in this layer."""
        return self.bytes_per_token(self.num_kv_heads, self.head_dim, self.v_head_dim, self.dtype)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in pages of this layout (before they exist: where to keep them)."""
        return num_kv_heads * (head_dim + v_head_dim) * dtype.itemsize

    def decode_streams(self, device: torch.device) -> bool:
        """Offloaded pages are streamed to the device through side streams at every step."""
        return self.offloaded

    def stored_tokens(self) -> int:
        return sum(filled for _, _, filled in self.segments)

    def nbytes(self) -> int:
        return self.stored_tokens() * self.token_bytes()

    def slack_bytes(self) -> int:
        if not self._writable_tail:
            return 0
        kb, _, filled = self.segments[-1]
        return (kb.shape[1] - filled) * self.token_bytes()

    def _empty_like(self) -> KVPages:
        """No tokens, this layer's layout, storage and CP rank (the class included: a family's subclass)."""
        return type(self)(
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
            self.page_size,
            self.dtype,
            self.storage,
            self.cp_rank,
            self.cp_size,
            self.offloaded,
        )

    def fork(self) -> KVPages:
        new = self._empty_like()
        new.num_tokens, new.segments = self.num_tokens, list(self.segments)
        new._host_written = self._host_written  # the shared segments' writes
        self._writable_tail = False  # neither may write past the shared `filled` any more
        return new

    @classmethod
    def planned_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2 * config.num_key_value_heads * head_dim * dtype_bytes * tokens_on_rank

    offloadable = True

    @classmethod
    def planned_offload_workspace(
        cls, config, layer_idx: int, tokens_on_rank: int, page_size: int, dtype_bytes: int = 2
    ) -> int:
        """:meth:`stream` holds two pages on the device: the one a kernel reads and the next one's copy."""
        return cls.planned_bytes(config, layer_idx, min(2 * page_size, tokens_on_rank), dtype_bytes)


class WindowKV(LayerState):
    """K/V of one sliding-window attention layer: only the prompt keys a later query can still see.

    HF's sliding-window mask lets the query at position ``x`` see keys ``y`` with ``x - window < y <= x``.
    Every later query (the replayed last prompt token at ``P - 1``, the response after it, the next
    capture chunk) sits at or after the state's end, so of the resident tokens only the last
    ``window - 1`` can ever be seen: the state keeps those, and its bytes stop growing with P.
    ``append`` rebinds the tensors (``cat`` then keep the tail; never written in place), so forks and
    earlier states stay valid. Every context-parallel rank runs every capture chunk with its whole K/V,
    so every rank holds the whole window (``sharded = False``: the window attention needs no
    collective). Offload leaves it on the compute device: it is small (``window - 1`` tokens a layer).
    """

    kind = "kv_window"
    sharded = False

    def __init__(self, window: int, k: torch.Tensor | None = None, v: torch.Tensor | None = None):
        if window < 1:
            raise LongStrawError(f"sliding window must be >= 1, got {window}")
        self.window, self.k, self.v = window, k, v  # k [Hkv, n, D], v [Hkv, n, Dv], n <= window - 1
        self.num_tokens = 0  # tokens appended over the prompt (all of them, not only those kept)

    @torch.no_grad()
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one chunk's ``k [Hkv, T, D]``, ``v [Hkv, T, Dv]`` and keep the last ``window - 1``."""
        after = self.extended(k, v)
        self.num_tokens = after.num_tokens
        # a copy of the tail, so the chunk's K/V (and the old window) are freed
        self.k, self.v = after.k.clone(), after.v.clone()

    def fork(self) -> WindowKV:
        new = type(self)(self.window, self.k, self.v)  # the class included: a subclass stays one
        new.num_tokens = self.num_tokens
        return new

    # the full gradient: the window at a boundary is a leaf (its K/V, fixed size) whose gradient the segment that
    # produced it takes back, as for GDN states; the window after a segment is `extended` under autograd
    grad_kind = "leaf"

    def grad_tensors(self) -> list[torch.Tensor | None]:
        return [self.k, self.v]

    def with_tensors(self, tensors: list[torch.Tensor | None]) -> WindowKV:
        new = type(self)(self.window, *tensors)
        new.num_tokens = self.num_tokens
        return new

    def extended(self, k: torch.Tensor, v: torch.Tensor) -> WindowKV:
        """This window after ``k [Hkv, T, D]``, ``v [Hkv, T, Dv]`` (differentiable in both and in this state's
        tensors: what a recomputed segment hands to the gradient the next segment sent to the window)."""
        num_tokens = self.num_tokens + k.shape[1]
        v = v.to(k.dtype)  # one dtype for K and V, as KVPages (under autocast RoPE can leave K in fp32)
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        start = max(k.shape[1] - (self.window - 1), 0)
        new = type(self)(self.window, k[:, start:], v[:, start:])
        new.num_tokens = num_tokens
        return new

    def stream(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.k is not None:
            yield self.k.to(device, non_blocking=True), self.v.to(device, non_blocking=True)

    def stored_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @classmethod
    def planned_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        """The window's tokens (at most ``config.sliding_window - 1``) times K/V bytes per token."""
        tokens = min(tokens_on_rank, max(config.sliding_window - 1, 0))
        return KVPages.planned_bytes(config, layer_idx, tokens, dtype_bytes)


class ConvRecurrentState(LayerState):
    """The fixed-size state of a recurrent (linear-attention or state-space) layer at the prompt boundary: a short
    conv's history and a recurrent state. Gated DeltaNet (``GDNState``) and Mamba-2 (``Mamba2State``) are its kinds;
    each sets :attr:`kind` and its own :meth:`planned_bytes`.

    ``conv`` holds the last ``kernel_size - 1`` pre-convolution inputs ``[B, C, kernel_size - 1]`` and
    ``recurrent`` the layer's recurrent state (fp32: ``[B, H, K, V]`` for GDN, ``[B, H, head_dim, N]`` for Mamba-2);
    ``B`` is 1 for a prompt, G while decoding. Its size does not depend on the prompt length; every context-parallel
    rank holds all of it (the capture chunk is replicated there), and offload leaves it on the device. ``append``
    rebinds the tensors (never writes into them), so forks and earlier states stay valid.
    """

    sharded = False

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None):
        self.conv, self.recurrent = conv, recurrent

    def append(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent

    def fork(self) -> ConvRecurrentState:
        return type(self)(self.conv, self.recurrent)

    def stream(self, device: torch.device):
        yield tuple(
            None if t is None else t.to(device, non_blocking=True) for t in (self.conv, self.recurrent)
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)

    # the full gradient: the boundary state is a leaf whose gradient is carried back to the segment before
    grad_kind = "leaf"

    def grad_tensors(self) -> list[torch.Tensor | None]:
        return [self.conv, self.recurrent]

    def with_tensors(self, tensors: list[torch.Tensor | None]) -> ConvRecurrentState:
        return type(self)(*tensors)

    @property
    def batch(self) -> int | None:
        """Sequences the state serves (``None``: the initial state, no tensors)."""
        return None if self.recurrent is None else self.recurrent.shape[0]

    def expand(self, batch: int) -> ConvRecurrentState:
        """This state for ``batch`` sequences (a view: no copy)."""
        return type(self)(self._expand(self.conv, batch), self._expand(self.recurrent, batch))

    def _expand(self, t: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        if t is None or t.shape[0] == batch:
            return t
        if t.shape[0] != 1:
            raise LongStrawError(
                f"a {type(self).__name__} of batch {t.shape[0]} cannot serve a batch of {batch}"
            )
        return t.expand(batch, *t.shape[1:])
