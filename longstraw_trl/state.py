"""The resident prompt state: what later tokens read of a captured prompt, and nothing else.

A :class:`PromptState` holds one :class:`LayerState` per decoder layer, the model-native state of the
prompt's first ``P - 1`` tokens:
- full-attention layers: K/V (:class:`KVPages`, grows with P, sharded over context-parallel ranks);
- sliding-window attention layers: the last ``window - 1`` tokens' K/V (:class:`WindowKV`, fixed size);
- other layer kinds (Gated DeltaNet's conv + recurrent state, an MLA latent, ...): the state class their
  family patch supplies (``FamilyPatch.layer_state_type``).
The last prompt token is kept as an id, not as a hidden state: every replay and every generation runs it
through the model together with the response (see docs/design.md, "Objective"), so the log-prob of
completion token 0 depends on every layer.

:class:`LayerState` is the protocol the engine, the planner, context parallelism and offload use; a
family adds a layer kind by subclassing it, without touching the engine. Replays only read the state;
``extend`` appends to a fork that shares what the original holds.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar, NamedTuple

import torch

from .errors import LongStrawError
from .kernels.host_gather import gather_rows_kernel, gather_rows_kernel_ok, gather_rows_reference


def _kept_on(kept: LayerState | None, device: torch.device) -> LayerState | None:
    """A kept boundary state (a ``"leaf"`` kind's snapshot) with its tensors on ``device`` (pinned when copied to
    the host from a GPU); itself when they are there already."""
    if kept is None or all(t is None or t.device == device for t in kept.grad_tensors()):
        return kept
    moved = []
    for t in kept.grad_tensors():
        if t is not None and device.type == "cpu" and t.device.type == "cuda":
            t = pinned_empty(tuple(t.shape), t.dtype).copy_(t)
        elif t is not None:
            t = t.to(device, non_blocking=True)
        moved.append(t)
    return kept.with_tensors(moved)


def storage_device(device: torch.device, offload: str | None) -> torch.device:
    if offload is None:
        return device
    if offload == "cpu":
        return torch.device("cpu")
    raise ValueError(f"offload must be None or 'cpu', got {offload!r}")


_COPY_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_STREAMED_BYTES = [0]


def streamed_bytes() -> int:
    """Bytes of offloaded prompt state copied from host memory to a device so far, by this process: a running
    total (read it before and after a phase). Every copy of a host-resident state goes through
    :func:`prefetch_to_device` or :func:`host_rows_to_device`, which count it."""
    return _STREAMED_BYTES[0]


def _count_streamed(*tensors: torch.Tensor | None) -> None:
    count_streamed_bytes(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def count_streamed_bytes(nbytes: int) -> None:
    """Add ``nbytes`` to :func:`streamed_bytes` (a CUDA graph's replay copies what its capture counted once)."""
    _STREAMED_BYTES[0] += nbytes


# cudaHostRegisterPortable | cudaHostRegisterMapped: every device may copy from the pages and read them in a kernel
_HOST_REGISTER_FLAGS = 3
_REGISTERED = {"bytes": 0}  # page-locked by pinned_empty and not yet released


def registered_host_bytes() -> int:
    """Bytes of host memory :func:`pinned_empty` holds page-locked now (released with their last view)."""
    return _REGISTERED["bytes"]


@functools.cache
def _registered_buffer_type() -> type:
    import numpy as np

    class RegisteredBuffer(np.ndarray):
        """A byte array page-locked with CUDA for its lifetime: the owner (not its views) unregisters its pages
        when it is freed, which a tensor made from it by ``torch.frombuffer`` delays until the tensor's storage
        is freed (the storage holds the array)."""

        def __del__(self):
            if self.base is None and getattr(self, "registered", 0):
                try:
                    torch.cuda.cudart().cudaHostUnregister(self.ctypes.data)
                except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone: the OS frees it
                    pass
                _REGISTERED["bytes"] -= self.registered
                self.registered = 0

    return RegisteredBuffer


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor of ``shape`` in page-locked memory of exactly its size.

    ``torch.empty(..., pin_memory=True)`` takes its pages from PyTorch's caching host allocator, which rounds
    every block up to a power of two: the GLM-5 slice's 3.9 GB of offloaded state held 6.7 GB pinned at 1M
    tokens (H200, rev 2b535a7), and a 1.2 GB page segment of GLM-5 took 2 GiB. Here
    the bytes are allocated pageable (numpy, untouched) and registered with CUDA (``cudaHostRegister``,
    portable and mapped, so kernels can read them: :mod:`kernels.host_gather`); the registration is released
    with the tensor's storage. Falls back to the caching allocator if the registration fails."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    buffer = _registered_buffer_type()(nbytes, dtype="uint8")
    status = int(torch.cuda.cudart().cudaHostRegister(buffer.ctypes.data, nbytes, _HOST_REGISTER_FLAGS))
    if status != 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    buffer.registered = nbytes
    _REGISTERED["bytes"] += nbytes
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def host_rows_to_device(host: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host[rows]`` (rows of a pinned host table, ``rows`` a 1-D index, ``-1``: a zero row) on ``device``,
    counted in :func:`streamed_bytes`: a decode step's chosen rows of an offloaded table.

    With ``rows`` on a CUDA device the GPU reads the rows from the mapped host memory itself
    (:func:`kernels.host_gather.gather_rows_kernel`): no host sync, so it can run inside a CUDA graph.
    Otherwise (or with ``LONGSTRAW_HOST_GATHER_KERNEL=0``) the rows are gathered on the host, into pinned memory
    when ``host`` is pinned (from pageable memory the copy would be a synchronous staged one), and copied."""
    if gather_rows_kernel_ok(host, rows, device):
        out = gather_rows_kernel(host, rows, device)
    else:
        out = gather_rows_reference(host, rows, device)
    _count_streamed(out)
    return out


def _copy_stream(device: torch.device, direction: str = "to_device") -> torch.cuda.Stream:
    # one side stream per direction: the gradients going to the host do not queue behind the pages coming back
    if (device, direction) not in _COPY_STREAMS:
        _COPY_STREAMS[device, direction] = torch.cuda.Stream(device=device)
    return _COPY_STREAMS[device, direction]


class HostAdds:
    """``dst += src`` for host tensors ``dst`` and device tensors ``src`` without the device waiting for the host.

    ``dst += src.to("cpu")`` is a synchronous copy into pageable memory plus an add by the CPU while the GPU idles.
    Here each ``src`` is copied into pinned staging memory on a side stream (the compute stream goes on), and a worker
    thread adds it into ``dst`` once that copy has landed. One worker, so the adds into a buffer happen in the order
    they were asked for; at most ``max_pending`` are in flight (each holds its staging copy), after which a new one
    waits for the oldest. Readers of the host tensors call :meth:`wait` first. With ``src`` on the host the add is
    done at once. The staging buffers are kept for reuse: allocating pinned memory waits for the device (CUDA's
    implicit synchronisation), so only the first ``max_pending + 1`` adds of a size do."""

    def __init__(self, max_pending: int = 8):
        self.max_pending = max_pending
        self._worker: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not src.is_cuda or dst.is_cuda:
            dst += src.to(dst.device, dst.dtype)
            return
        src = src.to(dst.dtype).contiguous()  # on the compute stream, queued like the kernel that made it
        copy = _copy_stream(src.device, "to_host")
        copy.wait_stream(torch.cuda.current_stream(src.device))
        staging = self._staging(src.numel(), src.dtype)
        with torch.cuda.stream(copy):
            staging.view(src.shape).copy_(src, non_blocking=True)
            landed = copy.record_event()
        src.record_stream(copy)  # its memory is not reused before the copy has read it
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="longstraw-host-adds")
        self._pending.append(self._worker.submit(self._add_when_landed, dst, staging, landed))
        while len(self._pending) > self.max_pending:
            self._pending.popleft().result()

    def wait(self) -> None:
        """Until every add asked for so far is in its host tensor (re-raises a failed add's error)."""
        while self._pending:
            self._pending.popleft().result()

    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def _add_when_landed(self, dst: torch.Tensor, staging: torch.Tensor, landed: torch.cuda.Event) -> None:
        # polled, not `landed.synchronize()`, which may hold the GIL while it waits (the main thread would then not
        # queue kernels until the copy had landed: the very wait this class removes)
        while not landed.query():
            time.sleep(2e-4)
        dst += staging.view(dst.shape)
        with self._lock:
            self._free.setdefault((staging.numel(), staging.dtype), []).append(staging)


#: the process's :class:`HostAdds` (the full gradient's dK/dV into offloaded pages' buffers, :class:`KVGrad`)
HOST_ADDS = HostAdds()


def prefetch_to_device(
    blocks: Iterable[tuple[torch.Tensor | None, ...]],
    device: torch.device,
    after: torch.cuda.Event | None = None,
) -> Iterator[tuple[torch.Tensor | None, ...]]:
    """``blocks`` (tuples of host tensors) on ``device``, each block's copy overlapping the previous one's compute.

    On CUDA the host-to-device copy of block ``j + 1`` is issued on a side stream as soon as block ``j`` is
    handed out, so it runs while the caller's kernels read block ``j`` (pinned host memory makes the copy
    asynchronous); the compute stream waits for each block's copy only when it receives that block. Each
    device tensor is marked as used by the compute stream (``record_stream``), so its memory is not reused
    while kernels still read it. Elsewhere (CPU), it is a plain ``.to(device)``. Any state kind whose blocks
    live on the host streams through here (offload), so every family overlaps its copies the same way.
    ``after``: an event of the compute stream the copies must wait for (the asynchronous device-to-host writes
    that filled the blocks: the side stream is otherwise not ordered after them).
    """
    if device.type != "cuda":
        for block in blocks:
            _count_streamed(*block)
            yield tuple(None if t is None else t.to(device) for t in block)
        return
    compute = torch.cuda.current_stream(device)
    copy = _copy_stream(device)
    if after is not None:
        copy.wait_event(after)

    def issue(block):
        _count_streamed(*block)
        with torch.cuda.stream(copy):
            moved = tuple(None if t is None else _host_to_device(t, device) for t in block)
        return moved, copy.record_event()

    pending = None
    for block in blocks:
        ahead = issue(block)
        if pending is not None:
            yield _receive(pending, compute)
        pending = ahead
    if pending is not None:
        yield _receive(pending, compute)


def _host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous copy of host tensor ``t`` (:func:`copy_across_devices`)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    copy_across_devices(out, t)
    return out


def copy_across_devices(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)``, asynchronous between pinned host memory and a device also where a side
    is not contiguous. torch copies such a pair through a contiguous temporary on the host, in pageable memory: a
    synchronous copy plus a gather or scatter by the CPU. A token range of a ``[heads, capacity, dim]`` segment is
    such a tensor (capture's writes of each chunk's K/V into an offloaded segment spent 82 of a 154 s capture there
    at 512K on an H100), so it is copied one head at a time, each head's rows being contiguous in the segment."""
    if src.is_cuda and dst.device != src.device:
        src = src.contiguous()  # a gather on the device, queued like the copies (no-op when contiguous)
    if (
        dst.device == src.device
        or dst.dim() < 2
        or (dst.is_contiguous() and src.is_contiguous())
        or not (dst[0].is_contiguous() and src[0].is_contiguous())
    ):
        dst.copy_(src, non_blocking=True)
        return
    for i in range(dst.shape[0]):
        dst[i].copy_(src[i], non_blocking=True)


def _receive(pending, compute: torch.cuda.Stream) -> tuple[torch.Tensor | None, ...]:
    moved, copied = pending
    compute.wait_event(copied)
    for t in moved:
        if t is not None:
            t.record_stream(compute)
    return moved


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

    # --- offload (``offload="cpu"``; the planner's ``--offload cpu``) --------------------------------------
    #: whether ``offload="cpu"`` keeps this kind in host memory (False: it stays on the device regardless)
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
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.dtype.itemsize

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


class KVGrad:
    """dK/dV of a loss with respect to the tokens one :class:`KVPages` holds on this rank (the full gradient).

    fp32 buffers in the layout of the pages' segments, on their storage device (host memory when the
    pages are offloaded), allocated when first written. Later tokens read the pages as constants: their
    attention backward hands each page's dK/dV to :meth:`sink`, and the segment that produced the tokens
    takes the sum back with :meth:`take`. A fork's buffers: the first ``shared`` segments are ``parent``'s
    (its buffers, or no gradient at all when ``parent`` is ``None``), the others its own.
    """

    def __init__(self, pages: KVPages, shared: int = 0, parent: KVGrad | None = None):
        self.pages, self.shared, self.parent = pages, shared, parent
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffer(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if j < self.shared:
            return None if self.parent is None else self.parent._buffer(j)
        if j not in self._buffers:
            kb, vb, filled = self.pages.segments[j]
            dv = None  # `grad_values` False: the values take no gradient
            if self.pages.grad_values:
                dv = torch.zeros(vb.shape[0], filled, vb.shape[2], dtype=torch.float32, device=vb.device)
            dk = torch.zeros(kb.shape[0], filled, kb.shape[2], dtype=torch.float32, device=kb.device)
            self._buffers[j] = (dk, dv)
        return self._buffers[j]

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for pair in self._buffers.values() for t in pair if t is not None
        )

    def sink(self, view: KVPages):
        """For the attention backward over ``view`` (this state or a :meth:`KVPages.prefix` of it): block
        index (``view.stream`` order) -> accumulator of that block's ``(dk, dv)``, or ``None`` (constant)."""
        blocks = list(view.blocks())

        def for_block(i: int):
            j, s, e = blocks[i]
            if self._buffer(j) is None:
                return None

            def add(dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
                bk, bv = self._buffer(j)
                if dk is not None:
                    HOST_ADDS.add(bk[:, s:e], dk)
                if dv is not None and bv is not None:
                    HOST_ADDS.add(bv[:, s:e], dv)

            return add

        return for_block

    def sink_joined(self, view: KVPages) -> Callable[[torch.Tensor | None, torch.Tensor | None], None]:
        """:meth:`sink` for a kernel that reads ``view``'s blocks joined into one table (in ``view.stream``
        order): the returned function takes the table's ``(dk [Hkv, N, D], dv)`` (either ``None``: no gradient
        there) and hands each block its rows."""
        blocks = list(view.blocks())
        for_block = self.sink(view)

        def add(dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
            at = 0
            for i, (_, s, e) in enumerate(blocks):
                sink = for_block(i)
                if sink is not None:
                    sink(
                        None if dk is None else dk[:, at : at + e - s],
                        None if dv is None else dv[:, at : at + e - s],
                    )
                at += e - s

        return add

    def take(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The accumulated ``(dk [Hkv, T, D], dv)`` of global tokens ``[start, end)`` on ``device``: this
        rank's owned tokens, zeros elsewhere (context parallelism: the caller all-reduces). Read-only: where one
        buffer holds the whole range (one rank, a segment's own tokens) it is a slice of that buffer, not a copy
        (zeros and a copy were four kernels per layer of every recomputed segment)."""
        pages = self.pages
        HOST_ADDS.wait()  # the dK/dV handed to offloaded buffers are all in them
        if pages.cp_size == 1:
            pieces = list(self._pieces(start, end - start))
            if len(pieces) == 1 and pieces[0][3] == (0, end - start):
                buf = self._buffer(pieces[0][0])
                if buf is not None and buf[1] is not None:
                    lo, hi = pieces[0][1:3]
                    return buf[0][:, lo:hi].to(device), buf[1][:, lo:hi].to(device)
        dk = torch.zeros(pages.num_kv_heads, end - start, pages.head_dim, device=device)
        dv = torch.zeros(pages.num_kv_heads, end - start, pages.v_head_dim, device=device)
        pos = start
        while pos < end:
            page, offset = divmod(pos, pages.page_size)
            n = min(pages.page_size - offset, end - pos) if pages.cp_size > 1 else end - pos
            if pages.owns(page):
                self._copy_stored(pages.stored_index(pos), n, dk, dv, pos - start)
            pos += n
        return dk, dv

    def _pieces(self, index: int, n: int) -> Iterator[tuple[int, int, int, tuple[int, int]]]:
        """Where stored tokens ``[index, index + n)`` lie: ``(segment, start, end within it, (start, end) within the
        n tokens)`` for each segment they touch."""
        base = 0
        for j, (_, _, filled) in enumerate(self.pages.segments):
            lo, hi = max(index, base), min(index + n, base + filled)
            if lo < hi:
                yield j, lo - base, hi - base, (lo - index, hi - index)
            base += filled

    def _copy_stored(self, index: int, n: int, dk: torch.Tensor, dv: torch.Tensor, out: int) -> None:
        for j, lo, hi, (a, b) in self._pieces(index, n):
            buf = self._buffer(j)
            if buf is not None:
                dst = slice(out + a, out + b)
                dk[:, dst] = buf[0][:, lo:hi].to(dk.device)
                if buf[1] is not None:
                    dv[:, dst] = buf[1][:, lo:hi].to(dv.device)


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


class PromptState:
    """The captured, read-only state of one prompt (see :func:`longstraw_trl.capture_prompt`).

    Attributes:
        num_tokens: prompt length P.
        resident_tokens: tokens held in the layer states, ``P - 1``: the last prompt token is replayed.
        last_token: id of the last prompt token (0-dim LongTensor on ``device``); every replay and
            generation runs it first, so completion token 0 is scored through the whole network.
        layers: per decoder-layer state (:class:`LayerState`), indexed by layer number.
        device: where replays compute. K/V live there too unless ``offload="cpu"``.
        offload: ``None`` (resident on ``device``) or ``"cpu"`` (pinned host memory, streamed per page).
        cp_group: the context-parallel process group the K/V pages are spread over (``None``: one rank).
        page_size: tokens per page (the unit of CP ownership and of offload streaming);
        chunk_size: prompt tokens per prefill step (``extend`` reuses it).
        chunk_seconds: seconds of each prefill chunk of the call that built this state (capture or extend).
    """

    def __init__(
        self,
        layers: dict[int, LayerState],
        device: torch.device,
        offload: str | None = None,
        cp_group=None,
        page_size: int = 0,
        chunk_size: int = 0,
    ):
        self.layers = layers
        self.chunk_size = chunk_size
        self.device = device
        self.offload = offload
        self.cp_group = cp_group
        self.page_size = page_size
        self.num_tokens = 0
        self.last_token: torch.Tensor | None = None
        self.chunk_seconds: list[float] = []
        # the full gradient (``capture_prompt(keep_boundaries=True)``): the resident tokens' ids, and at
        # every capture-chunk boundary (resident tokens before it) the fixed-size layers' states there
        self.token_ids: torch.Tensor | None = None
        self.boundaries: dict[int, dict[int, LayerState]] | None = None

    @property
    def resident_tokens(self) -> int:
        return max(self.num_tokens - 1, 0)

    def at(self, tokens: int) -> PromptState:
        """A read-only view of this state after its first ``tokens`` resident tokens (a segment boundary:
        growing layers give a prefix view, fixed-size ones the state kept there)."""
        if tokens == self.resident_tokens:
            return self
        if tokens == 0:  # the start of the sequence: every layer from its initial state
            view = PromptState({}, self.device, self.offload, self.cp_group, self.page_size, self.chunk_size)
            view.num_tokens = 1
            return view
        kept = (self.boundaries or {}).get(tokens)
        if kept is None:
            raise LongStrawError(
                f"the prompt state kept no layer states at token {tokens} (boundaries: "
                f"{sorted(self.boundaries or {})}): capture with keep_boundaries=True"
            )
        layers = {
            i: layer.prefix(tokens, _kept_on(kept.get(i), self.device)) for i, layer in self.layers.items()
        }
        view = PromptState(layers, self.device, self.offload, self.cp_group, self.page_size, self.chunk_size)
        view.num_tokens = tokens + 1
        return view

    def branch_point(self, tokens: int) -> int:
        """The most resident tokens, at most ``tokens``, after which :meth:`prefix_state` can give this state back:
        ``tokens`` itself when every layer's prefix is a view of what it holds (K/V pages, MLA latent pages);
        otherwise the last boundary kept at or before it (fixed-size layers, GDN or a sliding window, cannot be
        rewound: only their states kept at capture-chunk boundaries can), 0 when none is."""
        tokens = max(0, min(tokens, self.resident_tokens))
        if tokens == self.resident_tokens or all(layer.boundary() is None for layer in self.layers.values()):
            return tokens
        return max((t for t in self.boundaries or {} if t <= tokens), default=0)

    def prefix_state(self, tokens: int, last_token: torch.Tensor) -> PromptState:
        """The state of this prompt's first ``tokens + 1`` tokens, ``last_token`` (the id at position ``tokens``)
        being the last: a branch point that :meth:`extend` continues from. Growing layers give a view of their
        first ``tokens`` tokens (no copy), fixed-size ones the state kept there (``tokens`` must be a
        :meth:`branch_point`). What the full gradient keeps (token ids, boundaries) is cut there too."""
        if not 0 <= tokens <= self.resident_tokens:
            raise LongStrawError(
                f"prefix of {tokens} resident tokens asked of a state of {self.resident_tokens}"
            )
        kept = (self.boundaries or {}).get(tokens, {})
        if tokens == self.resident_tokens:
            layers = {i: layer.fork() for i, layer in self.layers.items()}
        else:
            layers = {i: layer.prefix(tokens, kept.get(i)) for i, layer in self.layers.items() if tokens}
        view = PromptState(layers, self.device, self.offload, self.cp_group, self.page_size, self.chunk_size)
        view.num_tokens, view.last_token = tokens + 1, last_token.view(()).to(self.device)
        if self.token_ids is not None:
            view.token_ids = self.token_ids[:tokens]
            view.boundaries = {t: k for t, k in (self.boundaries or {}).items() if t <= tokens}
        return view

    def keep_boundary(self, tokens: int) -> None:
        """Keep the fixed-size layers' states after ``tokens`` resident tokens (a segment boundary); with
        ``offload="cpu"`` they wait in host memory (one per capture chunk: 144 MiB each for Qwen3.6-27B) and
        :meth:`at` brings a boundary's back when its segment is recomputed."""
        if self.boundaries is None:
            self.boundaries = {}
        host = storage_device(self.device, self.offload)
        self.boundaries[tokens] = {
            i: _kept_on(kept, host)
            for i, layer in self.layers.items()
            if (kept := layer.boundary()) is not None
        }

    # --- bookkeeping ------------------------------------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held on this rank by kind of state (``kv``, ``gdn``, ...), allocation slack excluded."""
        out: dict[str, int] = {}
        for layer in self.layers.values():
            for kind, n in layer.nbytes_by_kind().items():
                out[kind] = out.get(kind, 0) + n
        return out

    def nbytes(self) -> int:
        """Total bytes of state held on this rank, allocation slack excluded."""
        return sum(self.nbytes_by_kind().values())

    def slack_bytes(self) -> int:
        """Allocated but unfilled bytes on this rank (reported apart from :meth:`nbytes`)."""
        return sum(layer.slack_bytes() for layer in self.layers.values())

    def fork(self) -> PromptState:
        new = PromptState(
            {i: s.fork() for i, s in self.layers.items()},
            self.device,
            self.offload,
            self.cp_group,
            self.page_size,
            self.chunk_size,
        )
        new.num_tokens, new.last_token = self.num_tokens, self.last_token
        new.token_ids = self.token_ids
        new.boundaries = None if self.boundaries is None else dict(self.boundaries)
        return new

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in self.nbytes_by_kind().items())
        return f"PromptState(num_tokens={self.num_tokens}, {kinds}, offload={self.offload})"

    # --- operations: the runtime's (engine, generation), wired in by the package (provide_operations) -----------
    def extend(self, model, more_ids: torch.Tensor, **kwargs) -> PromptState:
        """Append prompt tokens (e.g. a new turn); returns a new state sharing this one's K/V
        (:func:`longstraw_trl.engine.extend_state`)."""
        return _operations().extend(self, model, more_ids, **kwargs)

    def logprobs(
        self,
        model,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        grad: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """``[G, R]`` log-prob of each completion token given prompt + completion prefix
        (:func:`longstraw_trl.engine.replay_logprobs`).

        ``grad=True`` builds the autograd graph for exactly these rows: gradients reach the model's
        parameters through the last prompt token and the response (the state of the first ``P - 1``
        prompt tokens is a constant).
        """
        return _operations().logprobs(
            self, model, completion_ids, completion_mask, temperature, grad, **kwargs
        )

    def generate(self, model, num_generations: int, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Sample ``num_generations`` continuations sharing this prompt state (``[G, R]``, padded;
        :func:`longstraw_trl.generation.generate_from_state`)."""
        return _operations().generate(self, model, num_generations, max_new_tokens, **kwargs)

    def check_not_empty(self) -> None:
        if self.num_tokens == 0 or self.last_token is None:
            raise LongStrawError("PromptState is empty: capture a prompt first")


class StateOperations(NamedTuple):
    """What a :class:`PromptState` does with a model, implemented by the runtime above this module (the state is
    data; the package wires these in at import, :func:`provide_operations`)."""

    extend: Callable
    logprobs: Callable
    generate: Callable


_OPERATIONS: list[StateOperations] = []


def provide_operations(operations: StateOperations) -> None:
    """Set the runtime behind :meth:`PromptState.extend`, ``.logprobs`` and ``.generate`` (``longstraw_trl``'s
    ``__init__`` does, before any state exists)."""
    _OPERATIONS[:] = [operations]


def _operations() -> StateOperations:
    if not _OPERATIONS:
        raise LongStrawError("the LongStraw runtime is not loaded: import longstraw_trl")
    return _OPERATIONS[0]


# ----------------------------------------------------------------------------------------------------
# The full gradient's buffers: what a loss sends back to a prompt state
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
                "and reverse block replay support K/V pages and windows, MLA latent pages, Gated DeltaNet and Mamba-2 states)"
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

    def release(self, tokens: int) -> None:
        """Drop the leaves standing for the states after ``tokens`` resident tokens, and so their gradients: once
        the segment ending there has taken them (:func:`~longstraw_trl.engine.prompt_backward`), nothing reads them
        again. Kept, every boundary's leaf and gradient stayed on the device to the end of the prompt backward
        (the 27B's GDN layers: 2 x 144 MiB a capture chunk, 8.8 GiB more at 262K than at 16K on an H100)."""
        for key in [k for k in self._leaves if k[0] == tokens]:
            del self._leaves[key]

    def leaves_held(self) -> list[int]:
        """The boundaries (resident tokens) whose leaves are held now, sorted."""
        return sorted({tokens for tokens, _ in self._leaves})

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
