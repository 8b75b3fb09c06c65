"""Attention over chosen rows of a key table (``kernels.sparse_attention``) against plain fp64 math.

The reference (:func:`reference`) loops over queries: each one's softmax over exactly the rows it chose,
in fp64, differentiable. Both block forms are checked against it, forward and gradients: the gathered one
(:func:`selected_attention_block`, every table) and the masked dense one (:func:`masked_attention_block`,
a per-sequence table of few rows, what a replay's own response keys take).
"""

from __future__ import annotations

import pytest
import torch

import longstraw_trl.kernels.sparse_attention.dsa as sparse

SCALE = 0.3
VALUE_DIM = 5


def reference(q, table, rows, scale=SCALE, value_dim=VALUE_DIM):
    """fp64 ``(out [B, H, t, Dv], lse [B, H, t])``; a query that chose nothing: 0 and -inf."""
    b, h, t, _ = q.shape
    outs, lses = [], []
    for i in range(b):
        for j in range(t):
            chosen = [r for r in rows[i, j].tolist() if r >= 0]
            if not chosen:
                outs.append(q.new_zeros(h, value_dim, dtype=torch.float64))
                lses.append(torch.full((h,), float("-inf"), dtype=torch.float64))
                continue
            keys = (table[i] if table.dim() == 3 else table)[chosen].double()
            s = q[i, :, j].double() @ keys.T * scale  # [H, n]
            outs.append(torch.softmax(s, -1) @ keys[:, :value_dim])
            lses.append(torch.logsumexp(s, -1))
    out = torch.stack(outs).view(b, t, h, value_dim).transpose(1, 2)
    return out, torch.stack(lses).view(b, t, h).transpose(1, 2)


def case(b=2, h=3, t=7, n=9, d=8, k=4, shared=False, seed=0):
    """Queries, a table and each query's ``k`` distinct chosen rows (some slots -1; query 1 chose none)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    table = torch.randn(n, d, generator=gen, dtype=torch.float64)
    if not shared:
        table = torch.randn(b, n, d, generator=gen, dtype=torch.float64)
    rows = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b * t)]).view(b, t, k)
    rows[:, :, -1] = -1
    rows[:, 1] = -1
    return q, table, rows


@pytest.fixture(params=["gathered", "dense"])
def block_form(request, monkeypatch):
    """Which block form a per-sequence table takes; query blocks of 2 rows, so a call has several blocks."""
    monkeypatch.setattr(sparse, "DENSE_ROWS_PER_CHOICE", 0 if request.param == "gathered" else 1 << 20)
    monkeypatch.setattr(sparse, "ATTENTION_QUERY_ROWS", 4)
    return request.param


@pytest.mark.parametrize("shared", [False, True])
def test_forward_and_gradients_equal_the_reference(block_form, shared):
    q, table, rows = case(shared=shared)
    (qr, tr), (qg, tg) = ([x.clone().requires_grad_() for x in (q, table)] for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    d_out, d_lse = torch.randn(2, 3, 7, VALUE_DIM, generator=gen), torch.randn(2, 3, 7, generator=gen)

    out_ref, lse_ref = reference(qr, tr, rows)
    finite = torch.isfinite(lse_ref)
    ((out_ref * d_out).sum() + (lse_ref[finite] * d_lse[finite]).sum()).backward()
    out, lse = sparse.selected_attention(qg.float(), tg.float(), rows, SCALE, VALUE_DIM)
    assert torch.equal(torch.isfinite(lse), finite)
    ((out * d_out).sum() + (lse[finite] * d_lse[finite]).sum()).backward()

    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[finite].double(), lse_ref[finite], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qg.grad, qr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tg.grad, tr.grad, rtol=1e-5, atol=1e-6)


def test_half_table_gathered_under_autograd_rounds_as_without(monkeypatch):
    """A bf16 response table under autograd is gathered from one fp32 copy (its gradient sums in fp32), its rows
    rounded back to bf16: the output is bit-identical to the graph-free call's, the gradients near fp64's."""
    monkeypatch.setattr(sparse, "DENSE_ROWS_PER_CHOICE", 0)
    monkeypatch.setattr(sparse, "ATTENTION_QUERY_ROWS", 4)
    q, table, rows = case(n=12, k=6)
    qh, th = (x.bfloat16().requires_grad_() for x in (q, table))
    with torch.no_grad():
        out_free, lse_free = sparse.selected_attention(qh, th, rows, SCALE, VALUE_DIM)
    out, lse = sparse.selected_attention(qh, th, rows, SCALE, VALUE_DIM)
    assert torch.equal(out, out_free) and torch.equal(lse, lse_free)
    finite = torch.isfinite(lse)
    (out.sum() + lse[finite].sum()).backward()
    qr, tr = (x.bfloat16().double().requires_grad_() for x in (q, table))
    out_ref, lse_ref = reference(qr, tr, rows)
    (out_ref.sum() + lse_ref[finite].sum()).backward()
    assert th.grad.dtype == torch.bfloat16
    for got, ref in ((qh.grad, qr.grad), (th.grad, tr.grad)):
        assert (got.double() - ref).norm() <= 2e-2 * ref.norm()


def test_dense_form_is_taken_for_a_few_rows_only(monkeypatch):
    """The default threshold: a per-sequence table of up to 2 rows per choice is attended densely; more rows,
    or the shared prompt table, are gathered."""
    calls = []
    for name in ("masked_attention_block", "selected_attention_block"):
        real = getattr(sparse, name)
        monkeypatch.setattr(sparse, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    for n, shared, expected in [(8, False, "masked"), (9, False, "selected"), (8, True, "selected")]:
        calls.clear()
        q, table, rows = case(n=n, k=4, shared=shared)
        sparse.selected_attention(q.float(), table.float(), rows, SCALE, VALUE_DIM)
        assert calls and set(calls) == {f"{expected}_attention_block"}, (n, shared, calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_half_table_gradient_accumulates_in_fp32_on_cuda(monkeypatch):
    """64 queries chose the same 4 rows of a bf16 table, with zero queries: each attends uniformly (weight
    0.25), so a row's gradient is 0.25 x the sum of 64 output gradients in [1, 2), exact in fp32 (8-bit
    mantissas, 6 bits of growth): the bf16 gradient is that sum rounded once. CUDA's ``index_add_`` on a bf16
    tensor rounds after every atomic add instead (an emulated bf16 running sum is off by 2.0 here). (The
    CPU's bf16 ``index_add_`` sums in fp32 either way, so this runs on CUDA only. Not yet run on a GPU: an
    earlier form, 64 equal contributions, passed without the fp32 copy too: round-half-even cancelled.)"""
    monkeypatch.setattr(sparse, "DENSE_ROWS_PER_CHOICE", 0)  # the gathered form
    b, n, d, t = 1, 6, 8, 64
    table = torch.randn(b, n, d, device="cuda").bfloat16().requires_grad_()
    q = torch.zeros(b, 1, t, d, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(4, device="cuda").expand(b, t, 4).contiguous()
    out, _ = sparse.selected_attention(q, table, rows, SCALE, d)
    d_out = (1 + torch.rand(b, 1, t, d, generator=torch.Generator().manual_seed(0))).bfloat16().cuda()
    out.backward(d_out.float())
    expected = torch.zeros(b, n, d, dtype=torch.float64, device="cuda")
    expected[:, :4] = 0.25 * d_out.double().sum(2)
    assert table.grad.dtype == torch.bfloat16
    assert torch.equal(table.grad, expected.bfloat16())
