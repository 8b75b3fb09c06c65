"""Fused elementwise kernels of the decoder layer (RMSNorm, gated RMSNorm, SiLU-and-multiply), graph-free only.

Hugging Face's modules run these as chains of small kernels: ``Qwen3_5RMSNorm`` launches ten in bf16 (``x.float()``,
``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``*``, ``w.float()``, ``1 + w``, ``*``, ``type_as``) and makes as many passes
over an fp32 copy of its input; ``Qwen3_5RMSNormGated`` twelve; an MLP's ``act_fn(gate) * up`` two. Each kernel
here is one launch and one pass that keeps HF's cast points: every rounding HF does to the activation dtype
happens here at the same place, all other math in fp32, so the results are those of HF's module up to the fp32
summation order of the mean (which reorders, and may flip the rounding of, an output by one unit in the last
place) and the last bits of ``exp``/``rsqrt``.

Each kernel has its plain torch reference beside it: HF's own math, written out (``*_reference``).

RMSNorm variants (``variant``), with ``n = x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps)``:

- ``"zero_centered"`` (Qwen3.5 / Qwen3-Next / Gemma 2-3): ``(n * (1 + w_fp32)).to(x.dtype)``;
- ``"llama"`` (Llama, Mistral, Qwen2-3, GLM, DeepSeek): ``w * n.to(x.dtype)`` (in the promoted dtype of ``w``, ``x``);
- ``"gpt_oss"``: ``(w * n).to(x.dtype)`` (the product in fp32).

Gated (``Qwen3_5RMSNormGated``, ``Qwen3NextRMSNormGated``): ``(w * n.to(x.dtype)) * silu(gate_fp32)``, the first
product in the promoted dtype of ``w``, ``x``, the second in fp32, then ``.to(x.dtype)``.

SiLU-and-multiply (the MLPs): ``silu(gate) * up``, ``silu`` rounded to ``gate``'s dtype, the product to the promoted
dtype of ``gate``, ``up`` (as ``act_fn(gate_proj(x)) * up_proj(x)`` computes it).

Inputs: any leading shape, the normalised / multiplied dim last (``x.reshape(-1, d)``'s row stride is honoured:
a chunk of a wider projection is read in place); outputs are contiguous. No host syncs (CUDA-graph safe) and no
autograd: these are for capture and generation, never for a pass that is differentiated.
"""

from __future__ import annotations

import functools
import types
from typing import Literal

import numpy as np
import torch

try:
    # module-level names: the Triton interpreter (TRITON_INTERPRET=1) finds ``tl`` in the kernels' globals
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # no triton: the *_ok checks say so and the callers keep HF's forwards
    triton = tl = libdevice = None

RMSNormVariant = Literal["zero_centered", "llama", "gpt_oss"]
_VARIANTS = {"zero_centered": 0, "llama": 1, "gpt_oss": 2}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Where the kernels run. The CPU tests point this at "cpu" with the Triton interpreter on (tests/conftest.py).
_KERNEL_DEVICE = "cuda"

# One program holds whole rows in registers: rows up to this many elements (hidden sizes of today's models are
# up to 16384); :func:`rms_norm_ok` is False for longer ones, whose callers keep HF's forward.
MAX_NORM_DIM = 32768
# Elements a program handles: short rows (per-head norms) get several rows a program.
_TILE = 4096


def _norm_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps)``."""
    xf = x.to(torch.float32)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, variant: RMSNormVariant
) -> torch.Tensor:
    """The math of :func:`rms_norm` in plain torch: HF's forwards, cast for cast."""
    n = _norm_fp32(x, eps)
    if variant == "zero_centered":
        return (n * (1.0 + weight.float())).type_as(x)
    if variant == "llama":
        return weight * n.to(x.dtype)
    if variant == "gpt_oss":
        return (weight * n).to(x.dtype)
    raise ValueError(f"unknown RMSNorm variant {variant!r}; expected one of {sorted(_VARIANTS)}")


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The math of :func:`gated_rms_norm` in plain torch (``Qwen3_5RMSNormGated.forward``)."""
    out = weight * _norm_fp32(x, eps).to(x.dtype)
    out = out * torch.nn.functional.silu(gate.to(torch.float32))
    return out.to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The math of :func:`silu_mul` in plain torch (``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return torch.nn.functional.silu(gate) * up


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """The jit kernels, built on first use (an import of this module compiles nothing). No nested jit helpers:
    the Triton interpreter runs a kernel's source against the module's globals, where a helper defined in here
    is not."""
    interpret = bool(triton.knobs.runtime.interpret)

    # the row count varies (a capture chunk, its short last chunk, a decode step): not specialised on, so a new
    # count compiles nothing (Triton would otherwise compile again for M % 16 == 0 and for M == 1)
    @triton.jit(do_not_specialize=["M"])
    def rms_norm_kernel(
        X,
        G,
        W,
        Y,
        stride_x,
        stride_g,
        M,
        D,
        inv_d,
        eps,
        VARIANT: tl.constexpr,
        GATED: tl.constexpr,
        P_DTYPE: tl.constexpr,
        PRECISE_EXP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        in_d = cols < D
        mask = (rows < M)[:, None] & in_d[None, :]
        rows = rows.to(tl.int64)[:, None]  # rows * stride passes 2**31 elements in a long capture chunk
        x_dtype = X.dtype.element_ty
        x = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # torch's CUDA mean is sum * (1 / d) in fp32; padded lanes load 0 and add nothing
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)
        n = x * rstd[:, None]
        w = tl.load(W + cols, mask=in_d, other=0.0).to(tl.float32)[None, :]
        if GATED:  # (w * n.to(x.dtype)).to(P) * silu(gate_fp32), P the promoted dtype of w and x
            p = (w * n.to(x_dtype).to(tl.float32)).to(P_DTYPE).to(tl.float32)
            g = tl.load(G + rows * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            # torch's silu: g / (1 + exp(-g)), an IEEE division and CUDA's expf (libdevice; the interpreter has none)
            if PRECISE_EXP:
                e = libdevice.exp(-g)
            else:
                e = tl.exp(-g)
            out = p * tl.math.div_rn(g, 1.0 + e)
        elif VARIANT == 0:  # zero-centred: (n * (1 + w)).type_as(x)
            out = n * (1.0 + w)
        elif VARIANT == 1:  # llama: w * n.to(x.dtype)
            out = w * n.to(x_dtype).to(tl.float32)
        else:  # gpt_oss: (w * n).to(x.dtype)
            out = w * n
        tl.store(Y + rows * D + cols[None, :], out.to(Y.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def silu_mul_kernel(
        G,
        U,
        Y,
        stride_g,
        stride_u,
        M,
        N,
        PRECISE_EXP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        rows = rows.to(tl.int64)[:, None]
        g = tl.load(G + rows * stride_g + cols[None, :], mask=mask, other=0.0)
        u = tl.load(U + rows * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        if PRECISE_EXP:
            e = libdevice.exp(-gf)
        else:
            e = tl.exp(-gf)
        # silu rounded to gate's dtype (its own op in HF), then the product rounded to the output's
        a = tl.math.div_rn(gf, 1.0 + e).to(g.dtype).to(tl.float32)
        tl.store(Y + rows * N + cols[None, :], (a * u).to(Y.dtype.element_ty), mask=mask)

    return types.SimpleNamespace(
        rms_norm=rms_norm_kernel, silu_mul=silu_mul_kernel, interpret=interpret, precise_exp=not interpret
    )


_TL_DTYPES = (
    {} if tl is None else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
)


def kernels_ok(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: Triton importable, float16 / bfloat16 / float32 tensors on a CUDA
    device."""
    if triton is None:
        return False
    return all(t.device.type == _KERNEL_DEVICE and t.dtype in _DTYPES for t in tensors)


def rms_norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` / :func:`gated_rms_norm` serve ``x`` with ``weight`` (:func:`kernels_ok`, a 1-D
    weight of ``x``'s last dim, rows of up to :data:`MAX_NORM_DIM` elements)."""
    return (
        x.dim() > 0
        and weight.shape == (x.shape[-1],)
        and 0 < x.shape[-1] <= MAX_NORM_DIM
        and weight.device == x.device
        and kernels_ok(x, weight)
    )


@functools.cache
def _inv(d: int) -> float:
    """``1 / d`` rounded once to fp32, as torch's CUDA mean scales its sum (exact as an fp32 kernel argument)."""
    return float(np.float32(1.0) / np.float32(d))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(tile: int) -> int:
    """Warps for a program of ``tile`` elements: up to 32 fp32 values of each operand a thread."""
    return 4 if tile <= 4096 else 8 if tile <= 8192 else 16 if tile <= 16384 else 32


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as ``[rows, last dim]`` with a unit column stride (a view where one exists)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"{what} has dtype {t.dtype}; the fused kernels take float16, bfloat16 or float32")
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def _launch_norm(x, gate, weight, eps, variant_id, out_dtype, p_dtype):
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"RMSNorm weight of shape {tuple(weight.shape)} does not match the last dim of the input "
            f"{tuple(x.shape)}: the weight must be 1-D with the input's last dim"
        )
    if weight.device != x.device:
        raise ValueError(f"RMSNorm weight is on {weight.device}, the input on {x.device}: move them together")
    if weight.dtype not in _DTYPES:
        raise ValueError(f"RMSNorm weight has dtype {weight.dtype}; expected float16, bfloat16 or float32")
    x2 = _rows(x, "the RMSNorm input")
    g2 = x2 if gate is None else _rows(gate, "the gate")
    m, d = x2.shape
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if m == 0 or d == 0:
        return y
    if d > MAX_NORM_DIM:
        raise ValueError(f"RMSNorm rows of {d} elements: the fused kernel holds rows of up to {MAX_NORM_DIM}")
    block_d = _pow2(d)
    block_m = min(max(1, _TILE // block_d), _pow2(m))
    kernels = _kernels()
    kernels.rms_norm[(triton.cdiv(m, block_m),)](
        x2,
        g2,
        weight.contiguous(),
        y,
        x2.stride(0),
        g2.stride(0),
        m,
        d,
        _inv(d),
        float(eps),
        VARIANT=variant_id,
        GATED=gate is not None,
        P_DTYPE=_TL_DTYPES[p_dtype],
        PRECISE_EXP=kernels.precise_exp,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_m * block_d),
    )
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: RMSNormVariant) -> torch.Tensor:
    """:func:`rms_norm_reference` in one kernel: ``x [..., d]``, ``weight [d]`` (see the module docstring)."""
    if variant not in _VARIANTS:
        raise ValueError(f"unknown RMSNorm variant {variant!r}; expected one of {sorted(_VARIANTS)}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if variant == "llama" else x.dtype
    return _launch_norm(x, None, weight, eps, _VARIANTS[variant], out_dtype, torch.float32)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm_reference` in one kernel: ``x, gate [..., d]``, ``weight [d]``."""
    if gate.shape != x.shape or gate.device != x.device:
        raise ValueError(
            f"the gate ({tuple(gate.shape)} on {gate.device}) must have the shape and device of the input "
            f"({tuple(x.shape)} on {x.device})"
        )
    p_dtype = torch.promote_types(weight.dtype, x.dtype)
    return _launch_norm(x, gate, weight, eps, 0, x.dtype, p_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_reference` in one kernel: ``gate, up [..., n]`` of one shape."""
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(
            f"silu_mul needs gate and up of one shape and device, got {tuple(gate.shape)} on {gate.device} "
            f"and {tuple(up.shape)} on {up.device}"
        )
    if gate.dim() == 0:
        raise ValueError("silu_mul needs tensors of at least one dim")
    g2, u2 = _rows(gate, "the MLP gate"), _rows(up, "the MLP up projection")
    m, n = g2.shape
    y = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if m == 0 or n == 0:
        return y
    block_n = min(_pow2(n), 1024)
    block_m = min(max(1, _TILE // block_n), _pow2(m))
    kernels = _kernels()
    kernels.silu_mul[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        g2,
        u2,
        y,
        g2.stride(0),
        u2.stride(0),
        m,
        n,
        PRECISE_EXP=kernels.precise_exp,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return y
