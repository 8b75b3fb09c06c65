"""Attention that returns its log-sum-exp, and the exact merge of partial attentions.

A response (or prompt-chunk) query attends to two disjoint key sets: the prompt pages (every key visible)
and its own keys (causal). Each part yields ``(out, lse)``; they compose exactly:

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

The backward of a part needs only the *final* ``out`` and ``lse`` (the FlashAttention identity): with
``D_i = dO_i . O_i``, ``P_ij = exp(s_ij - lse_i)`` and ``dS_ij = P_ij (dO_i . v_j - D_i)``, the part
contributes ``dQ_i = scale * sum_j dS_ij k_j`` (and dK/dV for keys that are parameters' functions).
Prompt keys are constants, so their part computes dQ only.

Layouts: queries ``[B, Hq, T, D]``; response keys/values ``[B, Hkv, T, D]``; prompt pages
``[Hkv, L, D]`` shared by the whole batch. Grouped-query heads are folded into the query axis for the
prompt part (no mask there, so the ``Hq / Hkv`` query heads of one group are just more rows).

``*_reference`` functions are the plain torch math (the test oracle, and the path for soft-capped scores);
on CUDA the forward uses PyTorch's cuDNN attention op for calls with many queries and its flash-attention
op for decode (both return the LSE), the backward cuDNN's for calls with many queries and flash's otherwise. On CPU, forward and backward use
PyTorch's CPU flash-attention ops (``_scaled_dot_product_flash_attention_for_cpu``: the LSE is natural-log,
fp32, ``[B, H, T]``; it reads grouped K/V heads itself, takes any head dim, and its causal flag is
top-left aligned, so a causal call with fewer queries than keys passes an additive mask instead);
``LONGSTRAW_DISABLE=cpu_flash`` takes the plain math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import checkpoint

from ..runtime.switches import enabled
from .prompt_dq import prompt_dq, prompt_dq_ok

# The plain-math path processes keys in blocks so that one fp32 score tile stays under this many
# elements (1 GiB), whatever the number of query rows.
MATH_TILE_ELEMENTS = 1 << 28


def _key_block(q: torch.Tensor) -> int:
    rows = q.numel() // q.shape[-1]
    return max(128, min(1 << 16, MATH_TILE_ELEMENTS // max(rows, 1)))


def fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, T, D] -> [Hkv, B * rep * T, D]``: query heads of one KV group become extra rows."""
    b, hq, t, d = q.shape
    rep = hq // num_kv_heads
    return q.view(b, num_kv_heads, rep, t, d).permute(1, 0, 2, 3, 4).reshape(num_kv_heads, b * rep * t, d)


def unfold_gqa(x: torch.Tensor, batch: int, num_q_heads: int, seq: int) -> torch.Tensor:
    """Inverse of :func:`fold_gqa` for ``[Hkv, rows, ...]`` (out ``[..., D]`` or lse ``[...]``)."""
    hkv = x.shape[0]
    rep = num_q_heads // hkv
    tail = x.shape[2:]
    return (
        x.view(hkv, batch, rep, seq, *tail)
        .permute(1, 0, 2, 3, *range(4, 4 + len(tail)))
        .reshape(batch, num_q_heads, seq, *tail)
    )


def merge_partials(
    out_a: torch.Tensor | None, lse_a: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets (fp32 ``out`` and ``lse``)."""
    if out_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    # A part with no keys has lse = -inf; exp(-inf - finite) = 0 keeps it out.
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


# ----------------------------------------------------------------------------------------------------
# Plain torch math (reference and CPU path)
# ----------------------------------------------------------------------------------------------------
def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """fp32 scores ``q k^T * scale``, soft-capped to ``softcap * tanh(s / softcap)`` when given (Gemma 2:
    the cap applies to every score before the softmax, so the LSE of each part is over capped scores)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s


def attention_lse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    q_offset: int = 0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning ``(out fp32, lse fp32)`` for equal head counts ``[..., T, D]``.

    ``causal`` masks key ``j`` for query ``i`` when ``j > i + q_offset``; keys are processed in blocks
    with an online log-sum-exp so no ``[T, L]`` fp32 tile larger than one block is alive at once.
    ``softcap``: scores are soft-capped before the softmax (see :func:`_scores`).
    """
    out, lse = None, None
    block = _key_block(q)
    for start in range(0, k.shape[-2], block):
        kb = k[..., start : start + block, :]
        vb = v[..., start : start + block, :]
        s = _scores(q, kb, scale, softcap)
        if causal:
            qi = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
            kj = torch.arange(start, start + kb.shape[-2], device=q.device)[None, :]
            s = s.masked_fill(kj > qi, float("-inf"))
        m = s.amax(-1)
        m = torch.where(torch.isinf(m), 0.0, m)  # rows with every key masked: p = 0, lse = -inf
        p = torch.exp(s - m.unsqueeze(-1))
        total = p.sum(-1)
        lse_b = m + torch.log(total)
        out_b = torch.matmul(p, vb.float()) / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        out, lse = merge_partials(out, lse, out_b, lse_b)
    if out is None:  # no keys at all
        shape = q.shape[:-1]
        return q.new_zeros((*shape, v.shape[-1]), dtype=torch.float32), q.new_full(
            shape, float("-inf"), dtype=torch.float32
        )
    return out, lse


def attention_grad_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    causal: bool = False,
    q_offset: int = 0,
    need_kv: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of one key part given the *final* merged ``out``/``lse`` (fp32 results).

    ``need_kv=False`` (prompt pages) skips dK/dV. ``softcap``: the scores were soft-capped, so ``dS``
    is taken through ``d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2`` back to the raw scores.
    """
    dout = dout.float()
    delta = (dout * out.float()).sum(-1, keepdim=True)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32) if need_kv else None
    dv = torch.zeros_like(v, dtype=torch.float32) if need_kv else None
    qf = q.float()
    block = _key_block(q)
    for start in range(0, k.shape[-2], block):
        kb = k[..., start : start + block, :].float()
        vb = v[..., start : start + block, :].float()
        s = _scores(qf, kb, scale, softcap)
        # s = c tanh(raw / c): d s / d raw = 1 - (s / c)^2 (taken before masking: no inf * 0)
        cap_grad = 1 - (s / softcap).square() if softcap is not None else None
        if causal:
            qi = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
            kj = torch.arange(start, start + kb.shape[-2], device=q.device)[None, :]
            s = s.masked_fill(kj > qi, float("-inf"))
        p = torch.exp(s - lse.unsqueeze(-1))
        ds = p * (torch.matmul(dout, vb.transpose(-1, -2)) - delta)
        if cap_grad is not None:
            ds = ds * cap_grad
        dq += torch.matmul(ds, kb) * scale
        if need_kv:
            dk[..., start : start + kb.shape[-2], :] = torch.matmul(ds.transpose(-1, -2), qf) * scale
            dv[..., start : start + kb.shape[-2], :] = torch.matmul(p.transpose(-1, -2), dout)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# Fast path: PyTorch's flash-attention op returns the LSE (CUDA, fp16/bf16, head_dim <= 256)
# ----------------------------------------------------------------------------------------------------
def _flash_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and k.shape[-2] > 0
    )


# Below this many query rows per call (decode: G x Hq / Hkv rows), flash reads K/V at HBM speed while
# cuDNN does not (measured on an H200: 3.65 TB/s against 190 GB/s at 48 rows); above it cuDNN runs about
# twice flash's FLOP rate (641-648 against 297-319 TFLOP/s at 16K queries, head_dim 256).
CUDNN_MIN_QUERY_ROWS = 1024
_CUDNN_OK: dict = {}


def _cudnn_lse(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out.float(), lse.reshape(q.shape[:-1]).float()


def cudnn_attention_ok(q: torch.Tensor) -> bool:
    """Whether cuDNN attention with LSE runs and matches the plain math here (checked once per device,
    dtype and head dim, non-causal and causal; any error or mismatch means: use flash)."""
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _CUDNN_OK:
        try:
            g = torch.Generator(device=q.device).manual_seed(0)
            d = q.shape[-1]
            qq, kk, vv = (
                torch.randn(1, 2, n, d, device=q.device, dtype=q.dtype, generator=g) for n in (128, 192, 192)
            )
            ok = True
            for kx, vx, causal in ((kk, vv, False), (kk[:, :, :128], vv[:, :, :128], True)):
                out, lse = _cudnn_lse(qq, kx, vx, d**-0.5, causal)
                ref_out, ref_lse = attention_lse_reference(qq, kx, vx, d**-0.5, causal=causal)
                ok &= bool(((out - ref_out).norm() / ref_out.norm()).item() < 2e-2)
                ok &= bool((lse - ref_lse).abs().max().item() < 2e-2)
        except Exception:  # noqa: BLE001 - any failure means: use flash
            ok = False
        _CUDNN_OK[key] = ok
    return _CUDNN_OK[key]


# ----------------------------------------------------------------------------------------------------
# CPU fast path: PyTorch's CPU flash-attention ops return the LSE and take it back in backward
# ----------------------------------------------------------------------------------------------------
def _cpu_flash_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # (no keys or no queries: the op divides by zero, SIGFPE; the value head dim must equal the query's)
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-2] > 0
        and k.shape[-2] > 0
        and v.shape[-1] == q.shape[-1] == k.shape[-1]
        and q.dim() == 4
        and enabled("cpu_flash")
    )


def _causal_offset_mask(t: int, length: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask for queries that are the last ``t`` of ``length`` keys (``None`` when ``t == length``:
    the op's own top-left causal flag is then the same)."""
    if t == length:
        return None
    keep = torch.ones(t, length, dtype=torch.bool).tril(length - t)
    return torch.zeros(t, length, dtype=dtype).masked_fill(~keep, float("-inf"))


def _cpu_flash_lse(q, k, v, scale, causal):
    mask = _causal_offset_mask(q.shape[-2], k.shape[-2], q.dtype) if causal else None
    flag = causal and mask is None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, flag, attn_mask=mask, scale=scale
    )
    return out.float(), lse.float()


def _cpu_flash_grads(q, k, v, out, lse, dout, scale, causal):
    mask = _causal_offset_mask(q.shape[-2], k.shape[-2], q.dtype) if causal else None
    flag = causal and mask is None
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.to(q.dtype).contiguous(),
        lse.float().contiguous(),
        0.0,
        flag,
        attn_mask=mask,
        scale=scale,
    )
    return dq.float(), dk.float(), dv.float()


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out fp32, lse fp32)`` for ``[B, H, T, D]`` with equal head counts.

    ``causal`` aligns the last query with the last key (queries are the last ``T`` of the keys). On CUDA:
    cuDNN for calls of many query rows (prefill chunks, replays), flash for few (decode), both verified
    against the plain math once; on CPU, PyTorch's CPU flash op (:func:`_cpu_flash_ok`); the plain math
    elsewhere, and always with ``softcap`` (no op soft-caps scores).
    """
    if causal and q.shape[-2] == 1:
        causal = False  # one query after all its keys sees every key
    if softcap is None and _flash_ok(q, k) and (not causal or q.shape[-2] == k.shape[-2]):
        # (torch's causal flag is top-left aligned when T != L, so only T == L takes this path)
        if q.shape[-2] >= CUDNN_MIN_QUERY_ROWS and cudnn_attention_ok(q):
            return _cudnn_lse(q, k, v, scale, causal)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale
        )[:2]
        return out.float(), lse.float()
    if softcap is None and _cpu_flash_ok(q, k, v):
        return _cpu_flash_lse(q, k, v, scale, causal)
    offset = k.shape[-2] - q.shape[-2] if causal else 0
    return attention_lse_reference(q, k, v, scale, causal=causal, q_offset=offset, softcap=softcap)


def masked_decode_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    length: torch.Tensor,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new query per row over the first ``length`` keys of fixed-capacity buffers (decode).

    ``q [B, Hq, 1, D]``, ``k, v [B, Hkv, capacity, D]`` (grouped heads are folded, not expanded);
    ``length`` is a 0-dim device tensor, so the call has the same shapes at every step (CUDA graphs).
    Returns ``(out [B, Hq, 1, D], lse [B, Hq, 1])`` in fp32.
    """
    b, hq, t, d = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, hkv, (hq // hkv) * t, d)
    s = torch.einsum("bhrd,bhcd->bhrc", qg, k.float()) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    valid = torch.arange(cap, device=q.device) < length
    s = s.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhrc,bhcd->bhrd", torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.reshape(b, hq, t, v.shape[-1]), lse.reshape(b, hq, t)


_FLASH_AUX: dict = {}
_FLASH_BWD_OK: dict = {}


def _flash_aux(q: torch.Tensor):
    """The op's bookkeeping tensors (cumulative lengths, RNG state) for dense inputs without dropout."""
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _FLASH_AUX:
        x = torch.zeros(1, 1, 1, q.shape[-1], device=q.device, dtype=q.dtype)
        res = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        _FLASH_AUX[key] = (res[2], res[3], res[6], res[7])
    return _FLASH_AUX[key]


def _flash_grads(q, k, v, out, lse, dout, scale, causal):
    cum_q, cum_k, seed, offset = _flash_aux(q)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.to(q.dtype).contiguous(),
        lse.float().contiguous(),
        cum_q,
        cum_k,
        q.shape[-2],
        k.shape[-2],
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )
    return dq.float(), dk.float(), dv.float()


def flash_backward_ok(q: torch.Tensor) -> bool:
    """Whether the flash backward, fed the *final* merged out/LSE, matches the plain math here.

    Checked once per device/dtype/head-dim on a small problem; on any error or mismatch the plain math
    path is used (the op's private signature has changed across PyTorch releases).
    """
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _FLASH_BWD_OK:
        try:
            _FLASH_BWD_OK[key] = _backward_matches_reference(_flash_grads, q)
        except Exception:  # noqa: BLE001 - any failure means: use the math path
            _FLASH_BWD_OK[key] = False
    return _FLASH_BWD_OK[key]


_CUDNN_AUX: dict = {}
_CUDNN_BWD_OK: dict = {}


def _cudnn_aux(q: torch.Tensor):
    """The cuDNN op's bookkeeping outputs (cumulative lengths: none for dense inputs; RNG seed and offset)."""
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _CUDNN_AUX:
        x = torch.zeros(1, 1, 8, q.shape[-1], device=q.device, dtype=q.dtype)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
        _CUDNN_AUX[key] = (res[2], res[3], res[6], res[7])
    return _CUDNN_AUX[key]


def _cudnn_grads(q, k, v, out, lse, dout, scale, causal):
    """cuDNN's attention backward fed the *final* ``out``/``lse`` (the FlashAttention identity holds for it as for
    flash): about twice flash's rate at head dim 256 on Hopper, where flash's backward is FlashAttention-2's."""
    cum_q, cum_k, seed, offset = _cudnn_aux(q)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.to(q.dtype).contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.to(q.dtype).contiguous(),
        lse.float().contiguous().unsqueeze(-1),
        seed,
        offset,
        None,
        cum_q,
        cum_k,
        q.shape[-2],
        k.shape[-2],
        0.0,
        causal,
        scale=scale,
    )
    return dq.float(), dk.float(), dv.float()


def _backward_matches_reference(grads_fn, q: torch.Tensor) -> bool:
    """Whether ``grads_fn`` (flash's or cuDNN's backward), fed the final merged out/LSE of a part over half the keys
    merged with the other half, matches the plain math, non-causal and causal, on a small problem here."""
    g = torch.Generator(device=q.device).manual_seed(0)
    qq, kk, vv, do = (
        torch.randn(1, 2, 96, q.shape[-1], device=q.device, dtype=q.dtype, generator=g) for _ in range(4)
    )
    sc = q.shape[-1] ** -0.5
    o1, l1 = attention_lse(qq, kk[:, :, :48], vv[:, :, :48], sc)
    o2, l2 = attention_lse(qq, kk[:, :, 48:], vv[:, :, 48:], sc)
    out, lse = merge_partials(o1, l1, o2, l2)
    got = grads_fn(qq, kk[:, :, :48], vv[:, :, :48], out, lse, do, sc, False)
    ref = attention_grad_reference(qq, kk[:, :, :48], vv[:, :, :48], out, lse, do, sc)
    ok = all(((a - b).norm() / b.norm()).item() < 2e-2 for a, b in zip(got, ref, strict=True))
    oc, lc = attention_lse_reference(qq, kk[:, :, :96], vv[:, :, :96], sc, causal=True)
    got = grads_fn(qq, kk[:, :, :96], vv[:, :, :96], oc, lc, do, sc, True)
    ref = attention_grad_reference(qq, kk[:, :, :96], vv[:, :, :96], oc, lc, do, sc, causal=True)
    return ok and all(((a - b).norm() / b.norm()).item() < 2e-2 for a, b in zip(got, ref, strict=True))


def cudnn_backward_ok(q: torch.Tensor) -> bool:
    """Whether cuDNN's backward, fed the final merged out/LSE, matches the plain math here (checked once per device,
    dtype and head dim; any error or mismatch means: flash's backward). ``LONGSTRAW_DISABLE=cudnn_backward``: off."""
    if not enabled("cudnn_backward"):
        return False
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _CUDNN_BWD_OK:
        try:
            _CUDNN_BWD_OK[key] = cudnn_attention_ok(q) and _backward_matches_reference(_cudnn_grads, q)
        except Exception:  # noqa: BLE001 - any failure means: use flash
            _CUDNN_BWD_OK[key] = False
    return _CUDNN_BWD_OK[key]


def attention_grads(q, k, v, out, lse, dout, scale, causal=False, need_kv=True, softcap=None):
    """Gradients of one key part given the final ``out``/``lse``: cuDNN's backward for calls of many query rows and
    flash's otherwise, each where it is verified, else :func:`attention_grad_reference` (causal = queries are the
    last ``T`` of the keys, T == L; ``softcap`` always takes the plain math)."""
    if (
        softcap is None
        and _flash_ok(q, k)
        and q.shape[-2] >= CUDNN_MIN_QUERY_ROWS
        and (not causal or q.shape[-2] == k.shape[-2])
        and cudnn_backward_ok(q)
    ):
        dq, dk, dv = _cudnn_grads(q, k, v, out, lse, dout, scale, causal)
        return (dq, dk, dv) if need_kv else (dq, None, None)
    if softcap is None and _flash_ok(q, k) and flash_backward_ok(q):
        dq, dk, dv = _flash_grads(q, k, v, out, lse, dout, scale, causal)
        return (dq, dk, dv) if need_kv else (dq, None, None)
    if softcap is None and _cpu_flash_ok(q, k, v):
        dq, dk, dv = _cpu_flash_grads(q, k, v, out, lse, dout, scale, causal)
        return (dq, dk, dv) if need_kv else (dq, None, None)
    return attention_grad_reference(
        q, k, v, out, lse, dout, scale, causal=causal, need_kv=need_kv, softcap=softcap
    )


# ----------------------------------------------------------------------------------------------------
# Prompt part: queries against a sequence of read-only pages
# ----------------------------------------------------------------------------------------------------
PageIter = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]


def pages_attention(
    q: torch.Tensor, pages: PageIter, scale: float, num_kv_heads: int, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Attention of ``q [B, Hq, T, D]`` over all pages (no mask). Returns ``(out, lse)`` in the query
    layout (fp32), or ``(None, None)`` when there are no pages. ``pages()`` yields ``(k, v)`` of shape
    ``[Hkv, L, D]`` already on ``q``'s device."""
    b, hq, t, _ = q.shape
    qf = fold_gqa(q, num_kv_heads).unsqueeze(0)
    out, lse = None, None
    for k, v in pages():
        o, s = attention_lse(qf, k.unsqueeze(0), v.unsqueeze(0), scale, softcap=softcap)
        out, lse = merge_partials(out, lse, o, s)
    if out is None:
        return None, None
    return unfold_gqa(out[0], b, hq, t), unfold_gqa(lse[0], b, hq, t)


# block index (in ``pages()`` order) -> where that page's dK/dV go (``(dk, dv)``, fp32 ``[Hkv, L, D]``), or
# ``None`` when the page is a constant whose gradient nobody needs
PageGradSink = Callable[[int], Callable[[torch.Tensor, torch.Tensor], None] | None]


def pages_attention_dq(
    q: torch.Tensor,
    pages: PageIter,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    num_kv_heads: int,
    softcap: float | None = None,
    page_grads: PageGradSink | None = None,
) -> torch.Tensor:
    """dQ contribution of the prompt pages (fp32, query layout), given the final ``out``/``lse``.

    ``page_grads``: pages whose sink is not ``None`` also get their dK/dV (summed over the batch and the
    grouped query heads), handed to the sink: exact from the final ``out``/``lse`` like dQ."""
    b, hq, t, _ = q.shape
    qf = fold_gqa(q, num_kv_heads)
    of, df = fold_gqa(out, num_kv_heads), fold_gqa(dout, num_kv_heads)
    lf = fold_gqa(lse.unsqueeze(-1), num_kv_heads)[..., 0]
    dq = torch.zeros_like(qf, dtype=torch.float32)
    delta = None
    for i, (k, v) in enumerate(pages()):
        sink = page_grads(i) if page_grads is not None else None
        if sink is None and softcap is None and _use_prompt_dq() and prompt_dq_ok(qf, k):
            if delta is None:
                delta = (df.float() * of).sum(-1)  # D_i = dO_i . O_i, shared by every page
            dq += prompt_dq(qf, k, v, lf, delta, df, scale)
            continue
        dq_i, dk, dv = attention_grads(
            qf[None],
            k[None],
            v[None],
            of[None],
            lf[None],
            df[None],
            scale,
            need_kv=sink is not None,
            softcap=softcap,
        )
        dq += dq_i[0]
        if sink is not None:
            sink(dk[0], dv[0])
    return unfold_gqa(dq, b, hq, t)


def _use_prompt_dq() -> bool:
    # LONGSTRAW_DISABLE=prompt_dq takes the flash backward instead (for comparison)
    return enabled("prompt_dq")


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, Hkv, T, D] -> [B, Hkv * rep, T, D]`` (HF's grouped-query expansion)."""
    if rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)


def _self_attention_lse(q, k, v, scale, softcap=None):
    rep = q.shape[1] // k.shape[1]
    return attention_lse(q, repeat_kv(k, rep), repeat_kv(v, rep), scale, causal=True, softcap=softcap)


def merge_sink(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One more term of the LSE merge: a per-head sink logit ``sinks [Hq]`` in every row's softmax
    denominator (GPT-OSS), i.e. a key with score ``sinks[h]`` and a zero value. ``out [B, Hq, T, D]``,
    ``lse [B, Hq, T]`` fp32; ``None``: unchanged. Differentiable (the window path relies on autograd)."""
    if sinks is None:
        return out, lse
    sink = sinks.float().view(1, -1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1), total


# (out, lse, q) -> (out, lse): combines the prompt part over context-parallel ranks; q gives the shape
# when this rank holds no pages.
PartialReduce = Callable[
    [torch.Tensor | None, torch.Tensor | None, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]
]
# (dq of this rank's pages, dq of the replicated response part) -> the full dQ, identical on every rank
GradReduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PromptResponseAttention(torch.autograd.Function):
    """Exact attention of response queries over read-only prompt pages plus their own causal keys.

    Forward merges the two parts by LSE, then the sink term if the layer has one (:func:`merge_sink`).
    Backward returns dQ (from both parts) and dK/dV of the response keys; the pages are constants for
    autograd, and their dK/dV, where ``page_grads`` asks for them, go to its sinks (the full gradient). The sink is a key with a zero value, so the FlashAttention identity over the
    final (sink-merged) ``out``/``lse`` stays exact for the other parts, and the sink's own gradient is
    ``d sink_h = -sum_i exp(sink_h - lse_i) (dO_i . O_i)``. ``reduce_partial`` combines the prompt part
    across context-parallel ranks (identity on one rank) and ``reduce_dq`` sums the page dQ across them
    and adds the response part's. ``softcap`` soft-caps every score (both parts) before the merge.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, sinks, pages, scale, softcap, reduce_partial, reduce_dq, page_grads, prompt_part
    ):
        num_kv = k.shape[1]
        if prompt_part is not None:
            out_p, lse_p = prompt_part(q)
        else:
            out_p, lse_p = reduce_partial(*pages_attention(q, pages, scale, num_kv, softcap), q)
        out_s, lse_s = _self_attention_lse(q, k, v, scale, softcap)
        out, lse = merge_sink(*merge_partials(out_p, lse_p, out_s, lse_s), sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.pages, ctx.scale, ctx.softcap, ctx.reduce_dq = pages, scale, softcap, reduce_dq
        ctx.page_grads = page_grads
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        num_kv, rep = k.shape[1], q.shape[1] // k.shape[1]
        dq_pages = pages_attention_dq(
            q, ctx.pages, out, lse, dout, ctx.scale, num_kv, ctx.softcap, ctx.page_grads
        )
        dq_s, dk, dv = attention_grads(
            q,
            repeat_kv(k, rep),
            repeat_kv(v, rep),
            out,
            lse,
            dout,
            ctx.scale,
            causal=True,
            softcap=ctx.softcap,
        )
        dq = ctx.reduce_dq(dq_pages, dq_s)
        b, _, t, d = k.shape
        dk = dk.view(b, num_kv, rep, t, d).sum(2)
        dv = dv.view(b, num_kv, rep, t, v.shape[-1]).sum(2)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            delta = (dout.float() * out).sum(-1)  # [B, Hq, T]
            p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dsinks,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _no_reduce_partial(out, lse, q):
    return out, lse


def _no_reduce_dq(dq_pages, dq_self):
    return dq_pages + dq_self


def prompt_response_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: PageIter,
    scale: float,
    reduce_partial: PartialReduce | None = None,
    reduce_dq: GradReduce | None = None,
    self_length: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    page_grads: PageGradSink | None = None,
    prompt_part: Callable[[torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """Attention output ``[B, Hq, T, D]`` (q's dtype) of ``q`` over ``pages`` then causally over ``k, v``.

    Differentiable in ``q, k, v`` (and ``sinks``) when autograd is on; the pages are constants, whose
    dK/dV backward hands to ``page_grads`` where it names a sink (:func:`pages_attention_dq`).
    ``self_length`` (decode, no autograd): ``k, v`` are fixed-capacity buffers of which the first
    ``self_length`` keys are filled, the newest one being the query's own (:func:`masked_decode_attention_lse`).
    ``softcap``: scores soft-capped before the softmax (Gemma 2); ``sinks [Hq]``: one more term per head
    in the softmax denominator (GPT-OSS, :func:`merge_sink`). ``prompt_part``: under autograd, gives the
    (rank-reduced) ``(out, lse)`` of ``q`` over the pages in place of computing it here (the engine hands a
    checkpointed layer's recompute the part its first forward computed).
    """
    reduce_partial = reduce_partial or _no_reduce_partial
    reduce_dq = reduce_dq or _no_reduce_dq
    grads = (q, k, v) + ((sinks,) if sinks is not None else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in grads):
        return PromptResponseAttention.apply(
            q, k, v, sinks, pages, scale, softcap, reduce_partial, reduce_dq, page_grads, prompt_part
        )
    out_p, lse_p = reduce_partial(*pages_attention(q, pages, scale, k.shape[1], softcap), q)
    if self_length is not None:
        out_s, lse_s = masked_decode_attention_lse(q, k, v, scale, self_length, softcap)
    else:
        out_s, lse_s = _self_attention_lse(q, k, v, scale, softcap)
    return merge_sink(*merge_partials(out_p, lse_p, out_s, lse_s), sinks)[0].to(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Sliding-window layers: one masked attention over [window of prompt keys | own keys]
# ----------------------------------------------------------------------------------------------------
# Queries per block of the window path: each block reads at most ``block + window - 1`` keys. Under
# autograd each block is checkpointed (its scores are recomputed in backward), so the graph keeps only
# the block outputs: memory grows with the response times the head dim, not with the window.
WINDOW_QUERY_BLOCK = 256


def _window_block(q, keys, values, k_pos, q_pos, scale, window, softcap, sinks):
    """One query block: ``q [B, Hq, t, D]`` over ``keys/values [B, Hq, L, D]`` at positions ``k_pos``."""
    scores = _scores(q, keys, scale, softcap)
    visible = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # every query sees at least itself: finite
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values.float())
    return merge_sink(out, lse, sinks)[0]


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prompt_k: torch.Tensor | None,
    prompt_v: torch.Tensor | None,
    scale: float,
    window: int,
    self_length: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window attention of ``q [B, Hq, T, D]`` over the last ``n`` prompt keys
    ``prompt_k/v [Hkv, n, D]`` (shared by the batch; ``None``: none) and its own keys ``k, v [B, Hkv, S, D]``.

    Positions are relative to the call: prompt key ``j`` sits at ``j - n``, own key ``m`` at ``m``, query
    ``i`` at ``i + S - T`` (the queries are the last ``T`` own keys), or, in fixed-shape decoding, at
    ``self_length - 1`` (a 0-dim device tensor; ``S`` is then the buffer capacity and the unfilled slots
    lie after the query, so the causal condition masks them). Query at ``x`` sees key at ``y`` iff
    ``y <= x`` and ``x - y < window`` (HF's ``sliding_window_overlay`` on a causal mask). Plain torch,
    differentiable in ``q, k, v, sinks`` by autograd (blocks of :data:`WINDOW_QUERY_BLOCK` queries,
    checkpointed); ``softcap`` and ``sinks`` as in :func:`prompt_response_attention`. Returns
    ``[B, Hq, T, Dv]`` in q's dtype.
    """
    b, hq, t, _ = q.shape
    hkv, s_len = k.shape[1], k.shape[2]
    rep = hq // hkv
    n = 0 if prompt_k is None else prompt_k.shape[1]
    if n:
        keys = torch.cat([prompt_k.to(k.dtype).unsqueeze(0).expand(b, -1, -1, -1), k], dim=2)
        values = torch.cat([prompt_v.to(v.dtype).unsqueeze(0).expand(b, -1, -1, -1), v], dim=2)
    else:
        keys, values = k, v
    keys, values = repeat_kv(keys, rep), repeat_kv(values, rep)
    device = q.device
    k_pos = torch.arange(n + s_len, device=device) - n
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, sinks, prompt_k, prompt_v)
    )
    outs = []
    for a in range(0, t, WINDOW_QUERY_BLOCK):
        e = min(t, a + WINDOW_QUERY_BLOCK)
        if self_length is None:
            q_pos = torch.arange(a, e, device=device) + (s_len - t)
            # the keys the block can see: positions (q_pos[0] - window, q_pos[-1]]
            lo, hi = max(0, a + s_len - t - window + 1 + n), e + s_len - t + n
        else:
            q_pos, lo, hi = (self_length - 1).view(1), 0, n + s_len
        args = (q[:, :, a:e], keys[:, :, lo:hi], values[:, :, lo:hi], k_pos[lo:hi], q_pos)
        args += (scale, window, softcap, sinks)
        outs.append(checkpoint(_window_block, *args, use_reentrant=False) if grad else _window_block(*args))
    return torch.cat(outs, dim=2).to(q.dtype)
