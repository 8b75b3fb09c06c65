"""The GPU-side gather of a pinned host table's rows (``kernels.host_gather``) against plain indexing.

The reference is ``table[rows]`` itself (with ``-1`` as a zero row), not the module's torch path. The kernel
runs on the CPU under Triton's interpreter where Triton is installed, and on CUDA (``gpu``) reading a pinned
host table through the mapped address space, as an offloaded GLM-5 decode step does.
"""

from __future__ import annotations

import pytest
import torch

import longstraw_trl.kernels.host_gather.gather as hg
from longstraw_trl import host_memory
from longstraw_trl.kernels.host_gather import naive_gather_rows
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hg._kernel.cache_clear()
    yield
    hg._kernel.cache_clear()


def indexed(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table[rows]`` with ``-1`` a zero row: the plain meaning of the gather."""
    out = table[rows.clamp_min(0).cpu()].clone()
    out[(rows < 0).cpu()] = 0
    return out


def case(n=50, d=37, m=23, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen).to(dtype)
    rows = torch.randint(0, n, (m,), generator=gen)
    rows[::4] = -1
    return table, rows


@pytest.mark.parametrize("d", [37, 576, 1500], ids=["narrow", "glm-latent", "two-column-blocks"])
def test_kernel_under_the_interpreter(interpreter, d):
    table, rows = case(d=d, dtype=torch.float16, seed=d)
    out = hg.gather_rows_kernel(table, rows, torch.device("cpu"))
    assert torch.equal(out, indexed(table, rows))


@pytest.mark.parametrize("tile", hg.TILES, ids=[f"{r}rows-w{w}" for r, w in hg.TILES])
def test_every_tile_under_the_interpreter(interpreter, tile):
    table, rows = case(n=60, d=100, m=37, dtype=torch.float16, seed=1)  # 37 rows: a partial last row block
    assert torch.equal(
        hg.gather_rows_kernel(table, rows, torch.device("cpu"), tile=tile), indexed(table, rows)
    )


def test_reference_is_plain_indexing():
    table, rows = case()
    assert torch.equal(naive_gather_rows(table, rows, torch.device("cpu")), indexed(table, rows))


def test_kernel_serves_only_mapped_tables_and_device_rows():
    table, rows = case()
    assert not hg.gather_rows_kernel_available(
        table, rows, torch.device("cpu")
    )  # rows on the host: torch path
    if torch.cuda.is_available():
        assert not hg.gather_rows_kernel_available(table, rows.cuda(), torch.device("cuda"))  # pageable table


@pytest.mark.gpu
@cuda
def test_gpu_kernel_reads_a_pinned_host_table(monkeypatch):
    """The offloaded decode's case: latent table pinned on the host, rows chosen on the GPU, no host sync."""
    table, rows = case(n=100_000, d=576, m=8 * 2048)
    table = table.pin_memory()
    rows = rows.cuda()
    assert hg.gather_rows_kernel_available(table, rows, rows.device)
    out = hg.gather_rows_kernel(table, rows)
    assert out.is_cuda and torch.equal(out.cpu(), indexed(table, rows))
    for tile in hg.TILES:
        assert torch.equal(hg.gather_rows_kernel(table, rows, tile=tile), out), tile
    # host_rows_to_device takes it, and counts the bytes it brought over
    before = host_memory.streamed_bytes()
    via = host_memory.host_rows_to_device(table, rows, rows.device)
    assert torch.equal(via, out) and host_memory.streamed_bytes() - before == out.numel() * out.element_size()
    # and it can be captured in a CUDA graph (what the offloaded decode step needs): a replay reads the table anew
    static = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static.copy_(hg.gather_rows_kernel(table, rows))
    table.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.cpu(), indexed(table, rows))
    monkeypatch.setenv(DISABLE_ENV, hg.SWITCH)
    assert not hg.gather_rows_kernel_available(table, rows, rows.device)
    assert torch.equal(host_memory.host_rows_to_device(table, rows, rows.device), out * 2)


class FakeCudart:
    """Records what ``pinned_empty`` registers and unregisters (the CPU has no CUDA runtime)."""

    def __init__(self, status: int = 0):
        self.status, self.registered, self.unregistered = status, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
        self.registered.append((ptr, size, flags))
        return self.status

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinned_empty_registers_its_exact_bytes_until_the_last_view_is_freed(monkeypatch):
    import gc

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    before = host_memory.registered_host_bytes()
    t = host_memory.pinned_empty((3, 1000, 7), torch.bfloat16)
    assert t.shape == (3, 1000, 7) and t.dtype == torch.bfloat16
    ((ptr, size, flags),) = fake.registered
    assert ptr == t.data_ptr() and size == 3 * 1000 * 7 * 2 and flags == 3  # exact bytes; portable, mapped
    assert host_memory.registered_host_bytes() - before == size
    view = t[1, 10:20]
    view.fill_(1.5)
    del t
    gc.collect()
    assert fake.unregistered == [] and (view == 1.5).all()  # a view keeps the pages registered
    del view
    gc.collect()
    assert fake.unregistered == [ptr] and host_memory.registered_host_bytes() == before
    failing = FakeCudart(status=1)  # a refused registration: the caching allocator's pinned memory instead
    monkeypatch.setattr(torch.cuda, "cudart", lambda: failing)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: ("caching allocator", k.get("pin_memory")))
    assert host_memory.pinned_empty((4, 4), torch.float32) == ("caching allocator", True)
    assert host_memory.registered_host_bytes() == before


@pytest.mark.gpu
@cuda
def test_gpu_pinned_empty_is_page_locked_mapped_and_released():
    import gc

    before = host_memory.registered_host_bytes()
    table = host_memory.pinned_empty((100_000, 576), torch.bfloat16)
    assert table.is_pinned() and host_memory.registered_host_bytes() - before == 100_000 * 576 * 2
    table.copy_(torch.randn(100_000, 576).to(torch.bfloat16))
    rows = torch.randint(0, 100_000, (8 * 2048,), device="cuda")
    assert torch.equal(hg.gather_rows_kernel(table, rows).cpu(), indexed(table, rows))  # read in a kernel
    assert torch.equal(table[5:9].to("cuda", non_blocking=True).cpu(), table[5:9])  # and copied
    del table
    gc.collect()
    assert host_memory.registered_host_bytes() == before
