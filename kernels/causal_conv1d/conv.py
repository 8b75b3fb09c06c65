"""Depthwise causal conv1d that continues from a constant conv state (Gated DeltaNet's short conv).

HF's Qwen3.5 runs the conv on ``mixed_qkv`` laid out ``[B, C, T]`` with ``weight = conv1d.weight.squeeze(1)``
``[C, kernel_size]``, computes in the weight's dtype and casts the result back to the input's dtype. Its
cached path (``causal_conv1d_update``) writes the cache with ``copy_``; this one never writes its inputs.

Graph-free calls of several tokens on CUDA (a capture chunk) take flash-linear-attention's Triton kernel when
fla imports (:func:`_fla_conv`; ``LONGSTRAW_DISABLE=fla_conv`` keeps the torch path): it reads the ``[B, T, C]``
projection in place, with the state, and applies the SiLU in fp32, as HF's own fast path (``causal_conv1d_fn``)
does. The torch path (``cat`` + a depthwise conv on the transposed layout + SiLU) is the reference beside it; on
the whole Qwen3.6-27B it cost three passes over each chunk's conv input and about 2 ms a layer and chunk.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..runtime.autotune import pin_autotune_choices
from ..runtime.switches import enabled

__all__ = ["causal_conv1d_with_state"]

_ACTIVATIONS = {
    None: None,
    "identity": None,
    "silu": F.silu,
    "swish": F.silu,
}


def causal_conv1d_with_state(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    state_len: int | None = None,
    state_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of ``x`` given the inputs that preceded it.

    Args:
        x: ``[B, C, T]`` (any ``T >= 0``).
        weight: ``[C, kernel_size]`` (or ``[C, 1, kernel_size]`` as stored by ``nn.Conv1d``).
        bias: ``[C]`` or None.
        conv_state: ``[B, C, W]``, the last ``W`` pre-conv inputs before ``x`` (newest last), or None
            (zeros: the start of the sequence). Only its last ``kernel_size - 1`` columns are read; a
            narrower state is treated as zero-padded on the left. A constant: detached, never written.
        activation: ``"silu"`` (HF's ``hidden_act`` for Qwen3.5), ``"swish"``, ``"identity"`` or None.
        state_len: width of the returned state; default ``kernel_size - 1`` (HF's cache keeps
            ``kernel_size``).
        state_grad: ``conv_state`` is differentiable and so is the returned state (the full gradient:
            a boundary state as a leaf, the next boundary's state as an output).
    Returns:
        ``(y [B, C, T] in x.dtype, new_conv_state [B, C, state_len] in x.dtype)``: ``new_conv_state`` is a
        fresh detached tensor holding the last ``state_len`` inputs of ``concat(conv_state, x)``, ready to
        pass as ``conv_state`` to the next chunk.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported activation {activation!r}; use one of {sorted(map(str, _ACTIVATIONS))}"
        )
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    Bsz, C, T = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"weight has {weight.shape[0]} channels, x has {C}")
    ksize = weight.shape[-1]
    hist = ksize - 1
    L = hist if state_len is None else int(state_len)
    if _use_fla(x, weight, conv_state, state_grad, L, hist):
        return _fla_conv(x, weight, bias, conv_state, activation, hist)

    if conv_state is None:
        prev = x.new_zeros(Bsz, C, max(hist, L))
    else:
        if conv_state.shape[:2] != (Bsz, C):
            raise ValueError(f"conv_state must be [B, C, W] = [{Bsz}, {C}, W]; got {tuple(conv_state.shape)}")
        prev = (conv_state if state_grad else conv_state.detach()).to(device=x.device, dtype=x.dtype)
        need = max(hist, L) - prev.shape[-1]
        if need > 0:
            prev = F.pad(prev, (need, 0))
    if torch.is_grad_enabled() and x.requires_grad:
        x = _GradInInputLayout.apply(x)
    full = torch.cat([prev, x], dim=-1)  # [B, C, W' + T], W' >= kernel_size - 1

    tail = full[..., full.shape[-1] - L :] if state_grad else full[..., full.shape[-1] - L :].detach()
    new_state = tail.clone() if L > 0 else x.new_zeros(Bsz, C, 0)
    if T == 0:
        return x.new_zeros(Bsz, C, 0), new_state

    window = full[..., full.shape[-1] - (hist + T) :].to(weight.dtype)
    y = F.conv1d(window, weight.unsqueeze(1), bias, padding=0, groups=C)  # exactly T outputs
    act = _ACTIVATIONS[activation]
    if act is not None:
        y = act(y)
    return y.to(x.dtype), new_state


class _GradInInputLayout(torch.autograd.Function):
    """Identity whose backward hands ``x [B, C, T]`` its gradient in ``x``'s memory layout when ``x`` is the usual
    transposed view of a ``[B, T, C]`` projection. The ``cat`` above otherwise returns it as a slice of the
    ``[B, C, W' + T]`` gradient, whose odd row stride (``T + kernel_size - 1``) sent the projection's input-gradient
    GEMM to an unaligned cuBLAS kernel: 5.6 ms a Gated DeltaNet layer in an 8K-token segment of the 27B on an H100,
    about 4x an aligned one (revision 1d31a34)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.transposed = x.dim() == 3 and x.transpose(1, 2).is_contiguous()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if ctx.transposed:
            return grad.transpose(1, 2).contiguous().transpose(1, 2)
        return grad


@functools.cache
def _fla_conv_fn():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # not installed, or no triton / no GPU build
        return None
    pin_autotune_choices()  # see kernels/runtime/autotune.py
    return causal_conv1d


def _use_fla(x, weight, conv_state, state_grad, state_len, hist) -> bool:
    graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, conv_state)
    )
    return (
        x.is_cuda
        and x.shape[-1] > 1  # decoding steps keep the CUDA-graph-safe torch path
        and not graph
        and not state_grad
        and state_len == hist
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and enabled("fla_conv")
        and _fla_conv_fn() is not None
    )


def _fla_conv(x, weight, bias, conv_state, activation, hist):
    """fla's causal conv on ``x [B, C, T]`` (a transposed view of the ``[B, T, C]`` projection: read in place).

    fla's state is ``[B, C, kernel_size]`` and reads its last ``kernel_size - 1`` columns, newest last: ours
    with one zero column in front. Returns the torch path's ``(y [B, C, T], state [B, C, kernel_size - 1])``."""
    initial = None
    if conv_state is not None:
        prev = conv_state.detach().to(device=x.device, dtype=x.dtype)
        prev = prev[..., prev.shape[-1] - min(hist, prev.shape[-1]) :]  # its last kernel_size - 1 columns
        initial = F.pad(prev, (1 + hist - prev.shape[-1], 0)).contiguous()
    act = None if _ACTIVATIONS[activation] is None else "silu"
    y, final = _fla_conv_fn()(
        x.transpose(1, 2),
        weight,
        bias,
        initial_state=initial,
        output_final_state=True,
        activation=act,
    )
    return y.transpose(1, 2), final[..., 1:].contiguous()
