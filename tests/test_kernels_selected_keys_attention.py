"""The fused selected-keys attention kernel (``kernels.sparse_attention.selected_keys``) against plain fp64 math.

The reference is :func:`test_kernels_sparse_attention.reference` (each query's softmax over exactly the rows
it chose, fp64). The kernel rounds scores and probabilities to the inputs' half dtype where the torch path
does, so it is also held to the torch path on the same inputs, more tightly. Its tests run on the CPU under
Triton's interpreter where Triton is installed (fp16: the interpreter's bf16 ``tl.dot`` is broken), and on
CUDA at GLM-5's sizes (``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_sparse_attention import reference

import longstraw_trl.kernels.sparse_attention.dsa as sparse
import longstraw_trl.kernels.sparse_attention.selected_keys as ska
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ska._kernel.cache_clear()  # the kernel is built (jit or interpreted) when first used
    yield
    ska._kernel.cache_clear()


def half_case(b, h, t, n, d, k, shared, dtype=torch.float16, device="cpu", seed=0):
    """Half queries and table, each query's ``k`` distinct rows with some slots -1 and query 1 choosing none."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=gen).to(device=device, dtype=dtype)
    table = torch.randn(*(() if shared else (b,)), n, d, generator=gen).to(device=device, dtype=dtype)
    rows = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b * t)]).view(b, t, k)
    rows[:, :, ::5] = -1
    rows[:, 1] = -1
    return q, table, rows.to(device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "b,h,t,n,d,dv,k,shared",
    [
        (2, 3, 7, 90, 24, 16, 37, True),  # k over one row block, few heads, a shared table
        (2, 4, 5, 60, 20, 12, 33, False),  # per-sequence table, value dim not a power of two
        (1, 40, 3, 50, 16, 16, 20, True),  # two head blocks (the second partly masked), no rope part
    ],
    ids=["shared-table", "per-sequence-table", "two-head-blocks"],
)
def test_kernel_under_the_interpreter(interpreter, b, h, t, n, d, dv, k, shared):
    scale = d**-0.5
    q, table, rows = half_case(b, h, t, n, d, k, shared, seed=n)
    out, lse = ska.selected_attention_kernel(q, table, rows, scale, dv)
    out_ref, lse_ref = reference(q.double(), table.double(), rows, scale, dv)
    finite = torch.isfinite(lse_ref)
    assert not finite.all() and torch.equal(torch.isfinite(lse), finite)  # query 1 chose nothing
    assert (out[:, :, 1] == 0).all()
    torch.testing.assert_close(out.double(), out_ref, rtol=0, atol=4e-3)
    torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=0, atol=4e-3)
    torch_out, torch_lse = sparse.selected_attention_block(q.float(), table.float(), rows, scale, dv)
    half_out, _ = sparse.selected_attention_block(q, table, rows, scale, dv)  # the half torch path
    assert rel(out, out_ref) <= 2 * rel(half_out.float(), out_ref) + 1e-4
    assert rel(torch_out, out_ref) < 1e-6  # (the fp32 torch path is the same math as the fp64 reference)


@pytest.mark.parametrize("tile", ska.TILES, ids=[f"{h}x{n}w{w}s{st}" for h, n, w, st in ska.TILES])
def test_every_tile_under_the_interpreter(interpreter, tile):
    """Every tile the probe compares: 70 heads (a partial last head block at every width), 70 rows a query (a
    partial last row block at every width), value and rope parts of widths that are not powers of two."""
    q, table, rows = half_case(1, 70, 3, 90, 40, 70, True, seed=3)
    out, lse = ska.selected_attention_kernel(q, table, rows, 0.2, 24, tile=tile)
    out_ref, lse_ref = reference(q.double(), table.double(), rows, 0.2, 24)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(out.double(), out_ref, rtol=0, atol=4e-3)
    torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=0, atol=4e-3)


def test_kernel_rejects_mismatched_inputs(interpreter):
    q, table, rows = half_case(1, 2, 3, 10, 16, 4, True)
    with pytest.raises(ValueError, match="table"):
        ska.selected_attention_kernel(q, table[:, :8], rows, 0.3, 8)
    with pytest.raises(ValueError, match="rows"):
        ska.selected_attention_kernel(q, table, rows[:, :2], 0.3, 8)
    with pytest.raises(ValueError, match="value_dim"):
        ska.selected_attention_kernel(q, table, rows, 0.3, 17)
    with pytest.raises(ValueError, match="tile"):
        ska.selected_attention_kernel(q, table, rows, 0.3, 8, tile=(8, 8, 1, 1))
    out, lse = ska.selected_attention_kernel(q, table[:0], rows.clamp_max(-1), 0.3, 8)  # no table rows
    assert (out == 0).all() and torch.isinf(lse).all()


def test_graph_free_calls_take_the_kernel_and_graphs_do_not(interpreter, monkeypatch):
    """``selected_attention`` hands graph-free gathered calls to the kernel (its decision faked on the CPU),
    keeps the torch path under autograd and for the dense per-sequence form, and the real decision refuses
    CPU tensors, few query rows, fp32 and the switch."""
    calls = []
    kernel = ska.selected_attention_kernel
    monkeypatch.setattr(
        sparse, "selected_attention_kernel_available", lambda q, tab, rows: not q.requires_grad
    )
    monkeypatch.setattr(sparse, "selected_attention_kernel", lambda *a: calls.append(1) or kernel(*a))
    q, table, rows = half_case(2, 3, 7, 90, 24, 37, True)
    with torch.no_grad():
        out, lse = sparse.selected_attention(q, table, rows, 0.2, 16)
    assert calls == [1]
    ref_out, _ = reference(q.double(), table.double(), rows, 0.2, 16)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=4e-3)
    qg = q.float().requires_grad_()
    sparse.selected_attention(qg, table.float(), rows, 0.2, 16)
    assert calls == [1]
    few = table[None].expand(2, -1, -1)[:, :40]  # a per-sequence table of 40 rows for 37 choices: dense
    with torch.no_grad():
        sparse.selected_attention(q, few, rows.clamp_max(39), 0.2, 16)
    assert calls == [1]

    assert not ska.selected_attention_kernel_available(q, table, rows)  # CPU tensors
    if torch.cuda.is_available():
        qc, tc, rc = (x.cuda() for x in half_case(1, 2, 70, 90, 24, 8, True))
        assert ska.selected_attention_kernel_available(qc, tc, rc)
        assert not ska.selected_attention_kernel_available(qc[:, :, :8], tc, rc[:, :8])  # 8 query rows
        assert not ska.selected_attention_kernel_available(qc.float(), tc.float(), rc)
        monkeypatch.setenv(DISABLE_ENV, ska.SWITCH)
        assert not ska.selected_attention_kernel_available(qc, tc, rc)


# ----------------------------------------------------------------------------------------------------
# On CUDA, at GLM-5's sizes: 64 heads, latent keys of 576 with values of 512, top-2048
# ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "b,t,n,k,shared",
    [(1, 300, 70001, 2048, True), (2, 130, 5000, 100, False), (8, 9, 4133, 2048, True)],
    ids=["prompt-pages", "capture-chunk-own-keys", "replay-batch"],
)
def test_kernel_on_cuda_at_glm_sizes(b, t, n, k, shared):
    h, d, dv, scale = 64, 576, 512, 256**-0.5
    q, table, rows = half_case(b, h, t, n, d, k, shared, dtype=torch.bfloat16, device="cuda", seed=t)
    out, lse = ska.selected_attention_kernel(q, table, rows, scale, dv)
    torch_out, torch_lse = sparse.selected_attention_block(q, table, rows, scale, dv)
    sub = slice(0, min(t, 24))  # the fp64 per-query loop on a few queries
    out_ref, _ = reference(q[:, :, sub].double().cpu(), table.double().cpu(), rows[:, sub].cpu(), scale, dv)
    out_ref = out_ref.cuda()
    finite = torch.isfinite(torch_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (out[:, :, 1] == 0).all()
    assert rel(out, torch_out) <= 1e-2, rel(out, torch_out)
    assert (lse[finite] - torch_lse[finite]).abs().max() <= 2e-2
    assert rel(out[:, :, sub], out_ref) <= 1.5 * rel(torch_out[:, :, sub], out_ref) + 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile", ska.TILES, ids=[f"{h}x{n}w{w}s{st}" for h, n, w, st in ska.TILES])
def test_every_tile_on_cuda(tile):
    """Each tile the probe compares, at GLM-5's sizes against the torch path on the same bf16 inputs."""
    q, table, rows = half_case(1, 64, 100, 9000, 576, 700, True, dtype=torch.bfloat16, device="cuda", seed=1)
    out, lse = ska.selected_attention_kernel(q, table, rows, 256**-0.5, 512, tile=tile)
    torch_out, torch_lse = sparse.selected_attention_block(q, table, rows, 256**-0.5, 512)
    finite = torch.isfinite(torch_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert rel(out, torch_out) <= 1e-2, rel(out, torch_out)
    assert (lse[finite] - torch_lse[finite]).abs().max() <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_compiles_once_for_every_width_and_length():
    """A capture compacts each chunk's chosen rows to a new width, and its last chunk has one row less: compiled,
    the kernel loops to the width at run time and does not specialise the sizes or the strides that follow
    them, so none of these calls compiles it again (a compile was a 1 s stall in a capture chunk)."""
    _, kernel = ska._kernel()
    dev = torch.cuda.current_device()
    seen = None
    for t, k in ((64, 37), (63, 200), (65, 333), (64, 2048), (100, 129)):
        q, table, rows = half_case(1, 64, t, 4000, 576, k, True, dtype=torch.bfloat16, device="cuda", seed=k)
        out, _ = ska.selected_attention_kernel(q, table, rows, 256**-0.5, 512)
        torch_out, _ = sparse.selected_attention_block(q, table, rows, 256**-0.5, 512)
        assert rel(out, torch_out) <= 1e-2, (t, k, rel(out, torch_out))
        compiled = (
            len(kernel.device_caches[dev][0]) if hasattr(kernel, "device_caches") else len(kernel.cache[dev])
        )
        seen = compiled if seen is None else seen
        assert compiled == seen, f"t={t}, k={k} compiled the kernel again ({compiled} variants)"
