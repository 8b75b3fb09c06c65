"""Attention with its log-sum-exp by PyTorch's fused SDPA ops, forward and backward, where they serve.

On CUDA the forward uses PyTorch's cuDNN attention op for calls with many queries and its flash-attention op for
decode (both return the LSE), the backward cuDNN's for calls with many queries and flash's otherwise; each is
verified against the plain math (:mod:`.naive`) once per device, dtype and head dim before it is used. On CPU,
forward and backward use PyTorch's CPU flash-attention ops (``_scaled_dot_product_flash_attention_for_cpu``: the LSE
is natural-log, fp32, ``[B, H, T]``; it reads grouped K/V heads itself, takes any head dim, and its causal flag is
top-left aligned, so a causal call with fewer queries than keys passes an additive mask instead);
``LONGSTRAW_DISABLE=cpu_flash`` takes the plain math. Soft-capped scores always take the plain math (no op soft-caps).

The backwards are fed the *final* merged ``out``/``lse`` of all key parts (the FlashAttention identity), so one
part's gradients are exact whatever the other parts were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.switches import enabled
from .merge import merge_partials
from .naive import naive_attention_grads, naive_attention_lse

# Below this many query rows per call (decode: G x Hq / Hkv rows), flash reads K/V at HBM speed while
# cuDNN does not (measured on an H200: 3.65 TB/s against 190 GB/s at 48 rows); above it cuDNN runs about
# twice flash's FLOP rate (641-648 against 297-319 TFLOP/s at 16K queries, head_dim 256).
CUDNN_MIN_QUERY_ROWS = 1024

# fast path name -> (device, dtype, head dim) -> whether it ran and matched the plain math there
_VERIFIED: dict[str, dict] = {}
# op name -> (device, dtype, head dim) -> the op's bookkeeping outputs for dense inputs
_AUX: dict[str, dict] = {}


def _verified(path: str, q: torch.Tensor, check: Callable[[], bool]) -> bool:
    """``check()`` for fast path ``path``, run once per device, dtype and head dim of ``q``; any error means the
    path is not used (the ops' private signatures have changed across PyTorch releases)."""
    cache = _VERIFIED.setdefault(path, {})
    key = (q.device, q.dtype, q.shape[-1])
    if key not in cache:
        try:
            cache[key] = bool(check())
        except Exception:  # noqa: BLE001 - any failure means: the next path serves
            cache[key] = False
    return cache[key]


def _aux(op: str, q: torch.Tensor, rows: int, call: Callable[[torch.Tensor], tuple]) -> tuple:
    """An op's bookkeeping outputs for dense inputs without dropout (cumulative lengths, RNG seed and offset: its
    outputs 2, 3, 6, 7), from one ``call(x)`` on ``rows`` zero rows per device, dtype and head dim."""
    cache = _AUX.setdefault(op, {})
    key = (q.device, q.dtype, q.shape[-1])
    if key not in cache:
        res = call(torch.zeros(1, 1, rows, q.shape[-1], device=q.device, dtype=q.dtype))
        cache[key] = (res[2], res[3], res[6], res[7])
    return cache[key]


def _dense(q, k, v, out, lse, dout) -> tuple[torch.Tensor, ...]:
    """What the backward ops take: ``dout, q, k, v, out`` contiguous in q's dtype, ``lse`` contiguous fp32."""
    cast = (dout.to(q.dtype), q, k, v, out.to(q.dtype))
    return (*(x.contiguous() for x in cast), lse.float().contiguous())


def _floats(*grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(g.float() for g in grads)


# ----------------------------------------------------------------------------------------------------
# CUDA: flash (few query rows) and cuDNN (many), fp16/bf16, head_dim <= 256
# ----------------------------------------------------------------------------------------------------
def _flash_available(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and k.shape[-2] > 0
    )


def _flash_lse(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale
    )[:2]
    return out.float(), lse.float()


def _cudnn_lse(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out.float(), lse.reshape(q.shape[:-1]).float()


def _flash_grads(q, k, v, out, lse, dout, scale, causal):
    cum_q, cum_k, seed, offset = _aux(
        "flash",
        q,
        1,
        lambda x: torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False),
    )
    do, qc, kc, vc, oc, lc = _dense(q, k, v, out, lse, dout)
    return _floats(
        *torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do,
            qc,
            kc,
            vc,
            oc,
            lc,
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
    )


def _cudnn_grads(q, k, v, out, lse, dout, scale, causal):
    """cuDNN's attention backward fed the *final* ``out``/``lse`` (the FlashAttention identity holds for it as for
    flash): about twice flash's rate at head dim 256 on Hopper, where flash's backward is FlashAttention-2's."""
    cum_q, cum_k, seed, offset = _aux(
        "cudnn",
        q,
        8,
        lambda x: torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False),
    )
    do, qc, kc, vc, oc, lc = _dense(q, k, v, out, lse, dout)
    return _floats(
        *torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do,
            qc,
            kc,
            vc,
            oc,
            lc.unsqueeze(-1),
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
        )  # fmt: skip
    )


def _forward_matches_reference(lse_fn, q: torch.Tensor) -> bool:
    """Whether ``lse_fn`` matches the plain math, non-causal and causal, on a small problem here."""
    g = torch.Generator(device=q.device).manual_seed(0)
    d = q.shape[-1]
    qq, kk, vv = (
        torch.randn(1, 2, n, d, device=q.device, dtype=q.dtype, generator=g) for n in (128, 192, 192)
    )
    ok = True
    for kx, vx, causal in ((kk, vv, False), (kk[:, :, :128], vv[:, :, :128], True)):
        out, lse = lse_fn(qq, kx, vx, d**-0.5, causal)
        ref_out, ref_lse = naive_attention_lse(qq, kx, vx, d**-0.5, causal=causal)
        ok &= bool(((out - ref_out).norm() / ref_out.norm()).item() < 2e-2)
        ok &= bool((lse - ref_lse).abs().max().item() < 2e-2)
    return ok


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
    ref = naive_attention_grads(qq, kk[:, :, :48], vv[:, :, :48], out, lse, do, sc)
    ok = all(((a - b).norm() / b.norm()).item() < 2e-2 for a, b in zip(got, ref, strict=True))
    oc, lc = naive_attention_lse(qq, kk[:, :, :96], vv[:, :, :96], sc, causal=True)
    got = grads_fn(qq, kk[:, :, :96], vv[:, :, :96], oc, lc, do, sc, True)
    ref = naive_attention_grads(qq, kk[:, :, :96], vv[:, :, :96], oc, lc, do, sc, causal=True)
    return ok and all(((a - b).norm() / b.norm()).item() < 2e-2 for a, b in zip(got, ref, strict=True))


def cudnn_attention_available(q: torch.Tensor) -> bool:
    """Whether cuDNN attention with LSE runs and matches the plain math here (checked once per device, dtype and
    head dim, non-causal and causal; any error or mismatch means: use flash)."""
    return _verified("cudnn", q, lambda: _forward_matches_reference(_cudnn_lse, q))


def flash_backward_available(q: torch.Tensor) -> bool:
    """Whether the flash backward, fed the *final* merged out/LSE, matches the plain math here (checked once per
    device, dtype and head dim; any error or mismatch means: the plain math)."""
    return _verified("flash backward", q, lambda: _backward_matches_reference(_flash_grads, q))


def cudnn_backward_available(q: torch.Tensor) -> bool:
    """Whether cuDNN's backward, fed the final merged out/LSE, matches the plain math here (checked once per device,
    dtype and head dim; any error or mismatch means: flash's backward). ``LONGSTRAW_DISABLE=cudnn_backward``: off."""
    if not enabled("cudnn_backward"):
        return False
    return _verified(
        "cudnn backward",
        q,
        lambda: cudnn_attention_available(q) and _backward_matches_reference(_cudnn_grads, q),
    )


# ----------------------------------------------------------------------------------------------------
# CPU: PyTorch's CPU flash-attention ops return the LSE and take it back in backward
# ----------------------------------------------------------------------------------------------------
def _cpu_flash_available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
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
    do, qc, kc, vc, oc, lc = _dense(q, k, v, out, lse, dout)
    return _floats(
        *torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, qc, kc, vc, oc, lc, 0.0, flag, attn_mask=mask, scale=scale
        )
    )


# ----------------------------------------------------------------------------------------------------
# The paths chosen
# ----------------------------------------------------------------------------------------------------
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
    against the plain math once; on CPU, PyTorch's CPU flash op (:func:`_cpu_flash_available`); the plain math
    elsewhere, and always with ``softcap`` (no op soft-caps scores).
    """
    if causal and q.shape[-2] == 1:
        causal = False  # one query after all its keys sees every key
    if softcap is None and _flash_available(q, k) and (not causal or q.shape[-2] == k.shape[-2]):
        # (torch's causal flag is top-left aligned when T != L, so only T == L takes this path)
        if q.shape[-2] >= CUDNN_MIN_QUERY_ROWS and cudnn_attention_available(q):
            return _cudnn_lse(q, k, v, scale, causal)
        return _flash_lse(q, k, v, scale, causal)
    if softcap is None and _cpu_flash_available(q, k, v):
        return _cpu_flash_lse(q, k, v, scale, causal)
    offset = k.shape[-2] - q.shape[-2] if causal else 0
    return naive_attention_lse(q, k, v, scale, causal=causal, q_offset=offset, softcap=softcap)


def _fast_grads(q, k, v, causal, softcap) -> Callable | None:
    """The backward op that serves this call, or ``None`` (the plain math)."""
    if softcap is not None:
        return None
    if _flash_available(q, k):
        many = q.shape[-2] >= CUDNN_MIN_QUERY_ROWS and (not causal or q.shape[-2] == k.shape[-2])
        if many and cudnn_backward_available(q):
            return _cudnn_grads
        return _flash_grads if flash_backward_available(q) else None
    return _cpu_flash_grads if _cpu_flash_available(q, k, v) else None


def attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    causal: bool = False,
    need_kv: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of one key part given the final ``out``/``lse``: cuDNN's backward for calls of many query rows and
    flash's otherwise, each where it is verified, else :func:`.naive.naive_attention_grads` (causal = queries are
    the last ``T`` of the keys, T == L; ``softcap`` always takes the plain math)."""
    grads_fn = _fast_grads(q, k, v, causal, softcap)
    if grads_fn is None:
        return naive_attention_grads(
            q, k, v, out, lse, dout, scale, causal=causal, need_kv=need_kv, softcap=softcap
        )
    dq, dk, dv = grads_fn(q, k, v, out, lse, dout, scale, causal)
    return (dq, dk, dv) if need_kv else (dq, None, None)
