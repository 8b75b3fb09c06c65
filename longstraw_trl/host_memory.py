"""Host memory for offloaded prompt state: page-locked buffers of exactly their size, the side streams that copy
between the host and a device, and the count of bytes streamed back.

Every copy of a host-resident state to a device goes through :func:`prefetch_to_device` (blocks, overlapped with
compute) or :func:`host_rows_to_device` (a decode step's rows), which count it in :func:`streamed_bytes`;
:class:`HostAdds` adds device tensors into host tensors without the device waiting for the host.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .kernels.host_gather import gather_rows_kernel, gather_rows_kernel_available, naive_gather_rows


def storage_device(device: torch.device, offload: str | None) -> torch.device:
    """Where a prompt state offloaded as ``offload`` (``None`` or ``"cpu"``) keeps its tensors."""
    if offload is None:
        return device
    if offload == "cpu":
        return torch.device("cpu")
    raise ValueError(f"offload must be None or 'cpu', got {offload!r}")


class DeviceShare:
    """What of an offloaded prompt state stays on the device anyway: whole layers, in the order their states are
    created (layer order), while their bytes fit the budget; the rest goes to host memory and streams back. The
    capture (``capture_prompt(device_share=...)``) and the planner
    (:func:`~longstraw_trl.planner_terms.offload_bytes`) place layers by this one rule.

    Args:
        budget: device bytes the offloaded kinds' states may take (one budget for all the states captured with it).
    """

    def __init__(self, budget: int):
        self.budget = max(0, int(budget))
        self.left = self.budget

    def take(self, nbytes: int) -> bool:
        """Whether a layer state of ``nbytes`` stays on the device (its bytes are then taken from the budget)."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True

    @property
    def taken(self) -> int:
        """Bytes placed on the device so far."""
        return self.budget - self.left


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
    Otherwise (or with ``LONGSTRAW_DISABLE=host_gather_kernel``) the rows are gathered on the host, into pinned memory
    when ``host`` is pinned (from pageable memory the copy would be a synchronous staged one), and copied."""
    if gather_rows_kernel_available(host, rows, device):
        out = gather_rows_kernel(host, rows, device)
    else:
        out = naive_gather_rows(host, rows, device)
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
