"""Fused elementwise kernels of the decoder layer (RMSNorm, gated RMSNorm, SiLU-and-multiply), with backwards.

Hugging Face's modules run these as chains of small kernels: ``Qwen3_5RMSNorm`` launches ten in bf16 (``x.float()``,
``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``*``, ``w.float()``, ``1 + w``, ``*``, ``type_as``) and makes as many passes
over an fp32 copy of its input; ``Qwen3_5RMSNormGated`` twelve; an MLP's ``act_fn(gate) * up`` two. Each kernel
here is one launch and one pass that keeps HF's cast points: every rounding HF does to the activation dtype
happens here at the same place, all other math in fp32, so the results are those of HF's module up to the fp32
summation order of the mean (which reorders, and may flip the rounding of, an output by one unit in the last
place) and the last bits of ``exp``/``rsqrt``.

Each kernel has its plain torch reference beside it in ``naive``: HF's own math, written out (``naive_*``).

RMSNorm variants (``variant``), with ``n = x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps)``:

- ``"zero_centered"`` (Qwen3.5 / Qwen3-Next / Gemma 2-3): ``(n * (1 + w_fp32)).to(x.dtype)``;
- ``"llama"`` (Llama, Mistral, Qwen2-3, GLM, DeepSeek): ``w * n.to(x.dtype)`` (in the promoted dtype of ``w``, ``x``);
- ``"gpt_oss"``: ``(w * n).to(x.dtype)`` (the product in fp32).

Gated (``Qwen3_5RMSNormGated``, ``Qwen3NextRMSNormGated``): ``(w * n.to(x.dtype)) * silu(gate_fp32)``, the first
product in the promoted dtype of ``w``, ``x``, the second in fp32, then ``.to(x.dtype)``.

SiLU-and-multiply (the MLPs): ``silu(gate) * up``, ``silu`` rounded to ``gate``'s dtype, the product to the promoted
dtype of ``gate``, ``up`` (as ``act_fn(gate_proj(x)) * up_proj(x)`` computes it).

Inputs: any leading shape, the normalised / multiplied dim last (``x.reshape(-1, d)``'s row stride is honoured:
a chunk of a wider projection is read in place); outputs are contiguous. No host syncs (CUDA-graph safe).
``rms_norm`` / ``gated_rms_norm`` / ``silu_mul`` are graph-free (capture, generation). ``rms_norm_fn`` /
``gated_rms_norm_fn`` / ``silu_mul_fn`` are the same forwards as autograd functions, for passes that are
differentiated (replays, the prompt backward's recompute): they save their inputs alone, and one backward kernel
an op gives the gradients of the fp32 math above, with every rounding taken as the identity (as autograd takes a
cast) and each gradient rounded once to its input's dtype; the weight's gradient only when the weight requires
grad (fp32 partial sums a program, summed by torch). Inputs the kernels do not take go through the references.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import torch

from .naive import RMS_NORM_VARIANTS, RMSNormVariant, naive_gated_rms_norm, naive_rms_norm, naive_silu_mul

try:
    # module-level names: the Triton interpreter (TRITON_INTERPRET=1) finds ``tl`` in the kernels' globals
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # no triton: the *_available checks say so and the callers keep HF's forwards
    triton = tl = libdevice = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Where the kernels run. The CPU tests point this at "cpu" with the Triton interpreter on (tests/conftest.py).
_KERNEL_DEVICE = "cuda"

# One program holds whole rows in registers: rows up to this many elements (hidden sizes of today's models are
# up to 16384); :func:`rms_norm_available` is False for longer ones, whose callers keep HF's forward.
MAX_NORM_DIM = 32768
# Elements a program handles: short rows (per-head norms) get several rows a program.
_TILE = 4096


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

    # Backward of rms_norm_kernel (same VARIANT / GATED / P_DTYPE math): dx (and dgate) of a block of rows, and,
    # with HAS_DW, this program's fp32 partial sum of dweight over its blocks (summed over programs by torch).
    # Roundings of the forward to x's dtype / P are identity here, as autograd treats casts; the values they
    # feed (n.to(x.dtype) into the weight's gradient) are the rounded ones, as autograd saves them.
    @triton.jit(do_not_specialize=["M", "blocks_per_program"])
    def rms_norm_backward_kernel(
        X,
        G,
        W,
        DY,
        DX,
        DG,
        DW,
        stride_x,
        stride_g,
        stride_dy,
        M,
        D,
        inv_d,
        eps,
        blocks_per_program,
        VARIANT: tl.constexpr,
        GATED: tl.constexpr,
        P_DTYPE: tl.constexpr,
        PRECISE_EXP: tl.constexpr,
        HAS_DW: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        in_d = cols < D
        x_dtype = X.dtype.element_ty
        w = tl.load(W + cols, mask=in_d, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        # a while loop, not ``for b in range(blocks_per_program)``: the interpreter (numpy 2) cannot take a
        # runtime scalar argument as a range bound
        block = pid * blocks_per_program
        end = block + blocks_per_program
        while block < end:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            block += 1
            mask = (rows < M)[:, None] & in_d[None, :]
            rows = rows.to(tl.int64)[:, None]
            x = tl.load(X + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            # rstd recomputed as the forward computes it (padded lanes and rows load 0: n = 0, dy = 0)
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)[:, None]
            n = x * rstd
            if GATED:  # y = p * silu(g), p = (w * n.to(x.dtype)).to(P)
                n_x = n.to(x_dtype).to(tl.float32)
                p = (w * n_x).to(P_DTYPE).to(tl.float32)
                g = tl.load(G + rows * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if PRECISE_EXP:
                    e = libdevice.exp(-g)
                else:
                    e = tl.exp(-g)
                sig = 1.0 / (1.0 + e)
                dp = dy * (g * sig)
                # d silu(g) / dg = sig * (1 + g * (1 - sig)), torch's silu_backward
                dgate = dy * p * (sig * (1.0 + g * (1.0 - sig)))
                tl.store(DG + rows * D + cols[None, :], dgate.to(DG.dtype.element_ty), mask=mask)
                dn = dp * w
                dw_rows = dp * n_x
            elif VARIANT == 0:  # y = n * (1 + w)
                dn = dy * (1.0 + w)
                dw_rows = dy * n
            elif VARIANT == 1:  # y = w * n.to(x.dtype)
                dn = dy * w
                dw_rows = dy * n.to(x_dtype).to(tl.float32)
            else:  # y = w * n, in fp32
                dn = dy * w
                dw_rows = dy * n
            # n = x * rstd, rstd = (mean(x^2) + eps)^(-1/2): dx = rstd * (dn - n * mean(dn * n))
            dx = rstd * (dn - n * (tl.sum(dn * n, axis=1) * inv_d)[:, None])
            tl.store(DX + rows * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_DW:
                dw += tl.sum(dw_rows, axis=0)
        if HAS_DW:
            tl.store(DW + pid * D + cols, dw, mask=in_d)

    # Backward of silu_mul_kernel: y = a * u with a = silu(g) rounded to g's dtype (the value autograd saves):
    # du = dy * a, dg = dy * u * silu'(g), each rounded once to its input's dtype.
    @triton.jit(do_not_specialize=["M"])
    def silu_mul_backward_kernel(
        G,
        U,
        DY,
        DG,
        DU,
        stride_g,
        stride_u,
        stride_dy,
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
        dy = tl.load(DY + rows * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        if PRECISE_EXP:
            e = libdevice.exp(-gf)
        else:
            e = tl.exp(-gf)
        a = tl.math.div_rn(gf, 1.0 + e).to(g.dtype).to(tl.float32)
        sig = 1.0 / (1.0 + e)
        dg = dy * u * (sig * (1.0 + gf * (1.0 - sig)))
        tl.store(DG + rows * N + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + rows * N + cols[None, :], (dy * a).to(DU.dtype.element_ty), mask=mask)

    return types.SimpleNamespace(
        rms_norm=rms_norm_kernel,
        silu_mul=silu_mul_kernel,
        rms_norm_backward=rms_norm_backward_kernel,
        silu_mul_backward=silu_mul_backward_kernel,
        interpret=interpret,
        precise_exp=not interpret,
    )


_TL_DTYPES = (
    {} if tl is None else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
)


def elementwise_available(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve these tensors: Triton importable, float16 / bfloat16 / float32 tensors on a CUDA
    device."""
    if triton is None:
        return False
    return all(t.device.type == _KERNEL_DEVICE and t.dtype in _DTYPES for t in tensors)


def rms_norm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` / :func:`gated_rms_norm` serve ``x`` with ``weight`` (:func:`elementwise_available`, a 1-D
    weight of ``x``'s last dim, rows of up to :data:`MAX_NORM_DIM` elements)."""
    return (
        x.dim() > 0
        and weight.shape == (x.shape[-1],)
        and 0 < x.shape[-1] <= MAX_NORM_DIM
        and weight.device == x.device
        and elementwise_available(x, weight)
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
    """:func:`naive_rms_norm` in one kernel: ``x [..., d]``, ``weight [d]`` (see the module docstring)."""
    if variant not in RMS_NORM_VARIANTS:
        raise ValueError(f"unknown RMSNorm variant {variant!r}; expected one of {sorted(RMS_NORM_VARIANTS)}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if variant == "llama" else x.dtype
    return _launch_norm(x, None, weight, eps, RMS_NORM_VARIANTS[variant], out_dtype, torch.float32)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`naive_gated_rms_norm` in one kernel: ``x, gate [..., d]``, ``weight [d]``."""
    if gate.shape != x.shape or gate.device != x.device:
        raise ValueError(
            f"the gate ({tuple(gate.shape)} on {gate.device}) must have the shape and device of the input "
            f"({tuple(x.shape)} on {x.device})"
        )
    p_dtype = torch.promote_types(weight.dtype, x.dtype)
    return _launch_norm(x, gate, weight, eps, 0, x.dtype, p_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`naive_silu_mul` in one kernel: ``gate, up [..., n]`` of one shape."""
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


# ---------------------------------------------------------------------------------------------------------
# Under autograd: the forward kernels above, and one backward kernel an op
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def _dw_programs(device: torch.device) -> int:
    """Programs of a backward that sums the weight's gradient: each loops over its share of the rows and writes
    one fp32 partial row, so few programs keep the ``[programs, d]`` partials (and their sum) small. Two a
    multiprocessor on CUDA; on the CPU (the Triton interpreter, which runs programs one after another) three,
    so that the tests' short inputs already give several programs, several blocks each and a short last one."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def _norm_backward(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    dy: torch.Tensor,
    eps: float,
    variant_id: int,
    p_dtype: torch.dtype,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dgate, dweight)`` of :func:`rms_norm` / :func:`gated_rms_norm` (``dgate`` None without a gate,
    ``dweight`` None unless ``need_dw``), in the dtypes of ``x``, ``gate``, ``weight``."""
    x2 = _rows(x, "the RMSNorm input")
    g2 = x2 if gate is None else _rows(gate, "the gate")
    dy2 = _rows(dy, "the RMSNorm output's gradient")
    m, d = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dgate = None if gate is None else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if m == 0:
        return dx, dgate, torch.zeros_like(weight) if need_dw else None
    block_d = _pow2(d)
    block_m = min(max(1, _TILE // block_d), _pow2(m))
    blocks = triton.cdiv(m, block_m)
    # without dweight one block a program (the most parallelism); with it, a bounded number of programs
    programs = min(blocks, _dw_programs(x.device)) if need_dw else blocks
    per_program = triton.cdiv(blocks, programs)
    programs = triton.cdiv(blocks, per_program)
    partial = torch.empty((programs, d), dtype=torch.float32, device=x.device) if need_dw else dx
    kernels = _kernels()
    kernels.rms_norm_backward[(programs,)](
        x2,
        g2,
        weight.contiguous(),
        dy2,
        dx,
        dx if dgate is None else dgate,
        partial,
        x2.stride(0),
        g2.stride(0),
        dy2.stride(0),
        m,
        d,
        _inv(d),
        float(eps),
        per_program,
        VARIANT=variant_id,
        GATED=gate is not None,
        P_DTYPE=_TL_DTYPES[p_dtype],
        PRECISE_EXP=kernels.precise_exp,
        HAS_DW=need_dw,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_m * block_d),
    )
    return dx, dgate, partial.sum(0).to(weight.dtype) if need_dw else None


# The backward recomputes rstd from the saved input rather than saving the forward's fp32 [rows] rstd: the
# forward kernel stays as the graph-free path runs it (no extra output), and the backward loads each row anyway,
# so the sum of squares is one more in-register reduction. The saved tensors are the inputs alone, which the
# activation checkpointing of the replays frees and recomputes with the rest of the segment.
class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, variant):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.variant = eps, variant
        return rms_norm(x, weight, eps, variant)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, _, dw = _norm_backward(
            x,
            None,
            weight,
            dy,
            ctx.eps,
            RMS_NORM_VARIANTS[ctx.variant],
            torch.float32,
            ctx.needs_input_grad[1],
        )
        return dx if ctx.needs_input_grad[0] else None, dw, None, None


class _GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps
        return gated_rms_norm(x, gate, weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        p_dtype = torch.promote_types(weight.dtype, x.dtype)
        dx, dgate, dw = _norm_backward(x, gate, weight, dy, ctx.eps, 0, p_dtype, ctx.needs_input_grad[2])
        needs = ctx.needs_input_grad
        return dx if needs[0] else None, dgate if needs[1] else None, dw, None


def _silu_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of :func:`silu_mul`, in the dtypes of ``gate`` and ``up``."""
    g2, u2 = _rows(gate, "the MLP gate"), _rows(up, "the MLP up projection")
    dy2 = _rows(dy, "the SiLU product's gradient")
    m, n = g2.shape
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if m == 0 or n == 0:
        return dgate, dup
    block_n = min(_pow2(n), 1024)
    block_m = min(max(1, _TILE // block_n), _pow2(m))
    kernels = _kernels()
    kernels.silu_mul_backward[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        g2,
        u2,
        dy2,
        dgate,
        dup,
        g2.stride(0),
        u2.stride(0),
        dy2.stride(0),
        m,
        n,
        PRECISE_EXP=kernels.precise_exp,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return dgate, dup


class _SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = _silu_mul_backward(gate, up, dy)
        return dgate if ctx.needs_input_grad[0] else None, dup if ctx.needs_input_grad[1] else None


def rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: RMSNormVariant) -> torch.Tensor:
    """:func:`rms_norm` with a backward kernel (dx; dweight when ``weight`` requires grad). Inputs the kernels
    do not take (:func:`rms_norm_available` False) go through :func:`naive_rms_norm`, differentiated by torch."""
    if variant not in RMS_NORM_VARIANTS:
        raise ValueError(f"unknown RMSNorm variant {variant!r}; expected one of {sorted(RMS_NORM_VARIANTS)}")
    if not rms_norm_available(x, weight):
        return naive_rms_norm(x, weight, eps, variant)
    return _RMSNormFunction.apply(x, weight, eps, variant)


def gated_rms_norm_fn(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm` with a backward kernel (dx, dgate; dweight when ``weight`` requires grad); other
    inputs through :func:`naive_gated_rms_norm`."""
    if not (
        gate.shape == x.shape
        and gate.device == x.device
        and elementwise_available(gate)
        and rms_norm_available(x, weight)
    ):
        return naive_gated_rms_norm(x, gate, weight, eps)
    return _GatedRMSNormFunction.apply(x, gate, weight, eps)


def silu_mul_fn(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` with a backward kernel (dgate, dup); other inputs through :func:`naive_silu_mul`."""
    if not (gate.shape == up.shape and gate.dim() > 0 and elementwise_available(gate, up)):
        return naive_silu_mul(gate, up)
    return _SiluMulFunction.apply(gate, up)
