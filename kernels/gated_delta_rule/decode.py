"""One Gated DeltaNet decode step (one token per sequence) in two Triton kernels.

The torch path of a decode step (:func:`~longstraw_trl.kernels.causal_conv1d.causal_conv1d_with_state`, the
gating, :func:`~longstraw_trl.kernels.gated_delta_rule.gated_delta_step`, then copies into the running state)
is ~40 small kernels per layer. Here:

1. ``conv``: per channel block, the depthwise causal conv of the new input over the ``kernel_size - 1`` cached
   inputs (bias, SiLU), and the cache shifted by one with the new input appended;
2. ``delta``: per (sequence, value head, value block), q/k L2 norm, query scale, ``beta = sigmoid(b)``,
   ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32), the state decay, the delta-rule update and the output.

Both can write the new states into the tensors they read (``in_place``): a CUDA-graph decode step then reads
and writes the same storage every replay. Each program owns the state elements it rewrites (a channel block; a
``[Dk, BV]`` tile), and a barrier separates its reads from its writes, so the in-place update has no races.

Same math, rounding points and dtypes as the torch path: the conv window is cast to the weight's dtype, the
conv and the SiLU round to the weight's dtype and the result to the input's; ``beta`` rounds to ``b``'s dtype;
the rest is fp32; the output has the input's dtype. flash-linear-attention has the pieces but not this step:
its ``causal_conv1d_update`` keeps a ``kernel_size``-wide cache (ours is ``kernel_size - 1``) and its
``fused_recurrent_gated_delta_rule`` allocates a new final state per call and copies non-contiguous q/k/v.

``LONGSTRAW_DISABLE=gdn_decode`` makes :func:`gdn_decode_available` false (the model patch then takes the torch path).
"""

from __future__ import annotations

import functools

import torch

from ..runtime.switches import enabled

try:  # Triton's interpreter (the CPU tests) finds triton.language among the kernel's module globals
    import triton.language as tl
except ImportError:  # CPU installs without triton: the kernels are never built
    tl = None

__all__ = ["SWITCH", "gdn_decode_available", "gdn_decode_step"]

SWITCH = "gdn_decode"
_ACTIVATIONS = (None, "identity", "silu", "swish")
_BLOCK_C = 256  # channels per conv program
_BLOCK_V = 32  # value columns per delta-rule program: [Dk, 32] fp32 tiles, B * Hv * Dv / 32 programs


@functools.cache
def _kernels():
    """Build the kernels on first use (triton imported lazily: CPU installs have none; ``TRITON_INTERPRET`` is
    read when they are built)."""
    import triton

    @triton.jit
    def conv_kernel(
        x_ptr,  # [B, 1, C] new inputs
        sx_b,
        sx_c,
        w_ptr,  # [C, KS]
        sw_c,
        sw_k,
        bias_ptr,  # [C] or unused
        s0_ptr,  # [B, C, KS - 1] cached inputs (read)
        s0_b,
        s0_c,
        s0_w,
        s1_ptr,  # [B, C, KS - 1] new cache (written; may be s0)
        s1_b,
        s1_c,
        s1_w,
        y_ptr,  # [B, C] contiguous conv output
        C,
        KS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_STATE: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        i_b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = c < C
        x = tl.load(x_ptr + i_b * sx_b + c * sx_c, mask=mc, other=0)
        w_dtype = w_ptr.dtype.element_ty
        # the window is [cache_0 .. cache_{KS-2}, x] (oldest first), cast to the weight's dtype as torch does
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_STATE:
            for j in tl.static_range(KS - 1):
                col = tl.load(s0_ptr + i_b * s0_b + c * s0_c + j * s0_w, mask=mc, other=0).to(x.dtype)
                w_j = tl.load(w_ptr + c * sw_c + j * sw_k, mask=mc, other=0)
                acc += col.to(w_dtype).to(tl.float32) * w_j.to(tl.float32)
        w_x = tl.load(w_ptr + c * sw_c + (KS - 1) * sw_k, mask=mc, other=0)
        acc += x.to(w_dtype).to(tl.float32) * w_x.to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=mc, other=0).to(tl.float32)
        y = acc.to(w_dtype)
        if SILU:
            yf = y.to(tl.float32)
            y = (yf * tl.sigmoid(yf)).to(w_dtype)
        tl.store(y_ptr + i_b * C + c, y.to(x.dtype), mask=mc)
        tl.debug_barrier()  # in place: the whole cache block is read before it is rewritten
        # shift by one: column j takes column j + 1 (re-read before column j + 1 is itself rewritten)
        s1_dtype = s1_ptr.dtype.element_ty
        for j in tl.static_range(KS - 2):
            if HAS_STATE:
                nxt = tl.load(s0_ptr + i_b * s0_b + c * s0_c + (j + 1) * s0_w, mask=mc, other=0).to(x.dtype)
            else:
                nxt = tl.zeros([BLOCK_C], dtype=x.dtype)
            tl.store(s1_ptr + i_b * s1_b + c * s1_c + j * s1_w, nxt.to(s1_dtype), mask=mc)
        tl.store(s1_ptr + i_b * s1_b + c * s1_c + (KS - 2) * s1_w, x.to(s1_dtype), mask=mc)

    @triton.jit
    def delta_kernel(
        y_ptr,  # [B, C] conv output: q (Hk * Dk), k (Hk * Dk), v (Hv * Dv)
        C,
        a_ptr,  # [B, 1, Hv]
        sa_b,
        sa_h,
        b_ptr,  # [B, 1, Hv]
        sb_b,
        sb_h,
        A_log_ptr,  # [Hv]
        dt_bias_ptr,  # [Hv]
        h0_ptr,  # [B, Hv, Dk, Dv] fp32 (read)
        h0_b,
        h0_h,
        h0_k,
        h0_v,
        ht_ptr,  # [B, Hv, Dk, Dv] fp32 (written; may be h0)
        ht_b,
        ht_h,
        ht_k,
        ht_v,
        o_ptr,  # [B, 1, Hv, Dv] contiguous
        scale,
        HK: tl.constexpr,
        HV: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        HAS_STATE: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        i_b, i_hv = pid // HV, pid % HV
        i_h = i_hv // (HV // HK)  # HF's repeat_interleave: q/k head i serves value heads i*rep .. i*rep+rep-1
        o_k = tl.arange(0, BK)
        o_v = tl.program_id(1).to(tl.int64) * BV + tl.arange(0, BV)
        mk, mv = o_k < DK, o_v < DV
        row = y_ptr + i_b * C
        q = tl.load(row + i_h * DK + o_k, mask=mk, other=0).to(tl.float32)
        k = tl.load(row + HK * DK + i_h * DK + o_k, mask=mk, other=0).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + i_hv * DV + o_v, mask=mv, other=0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)

        b_raw = tl.load(b_ptr + i_b * sb_b + i_hv * sb_h)
        # torch: b.sigmoid() rounds to b's dtype; a + dt_bias and the rest in fp32
        beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
        x = tl.load(a_ptr + i_b * sa_b + i_hv * sa_h).to(tl.float32)
        x += tl.load(dt_bias_ptr + i_hv).to(tl.float32)
        # torch's softplus: x above 20, else log1p(exp(x)), log1p as log(u) * e / (u - 1) (Kahan: exact to a few
        # ulp for tiny e, where log(1 + e) would lose it all)
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        softplus = tl.where(x > 20.0, x, log1p)
        g = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32)) * softplus

        mh = mk[:, None] & mv[None, :]
        if HAS_STATE:
            p_h0 = h0_ptr + i_b * h0_b + i_hv * h0_h + o_k[:, None] * h0_k + o_v[None, :] * h0_v
            h = tl.load(p_h0, mask=mh, other=0).to(tl.float32)
        else:
            h = tl.zeros([BK, BV], dtype=tl.float32)
        h = h * tl.exp(g)
        delta = (v - tl.sum(h * k[:, None], 0)) * beta  # the part of v the state does not predict
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], 0)
        tl.store(o_ptr + (i_b * HV + i_hv) * DV + o_v, o.to(o_ptr.dtype.element_ty), mask=mv)
        tl.debug_barrier()  # in place: the whole tile is read before it is rewritten
        p_ht = ht_ptr + i_b * ht_b + i_hv * ht_h + o_k[:, None] * ht_k + o_v[None, :] * ht_v
        tl.store(p_ht, h, mask=mh)

    return triton, conv_kernel, delta_kernel


def _triton_importable() -> bool:
    try:
        _kernels()
    except Exception:  # no triton (CPU installs, CI)
        return False
    return True


def gdn_decode_available(*tensors: torch.Tensor | None) -> bool:
    """Whether :func:`gdn_decode_step` serves a call on these tensors: all on CUDA, none needing a gradient
    (the kernels are forward only), Triton importable, and ``gdn_decode`` not in ``LONGSTRAW_DISABLE``."""
    if not enabled(SWITCH):
        return False
    present = [t for t in tensors if t is not None]
    if not present or not all(t.is_cuda for t in present):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    return _triton_importable()


def _checked_inputs(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    Hv: int,
    conv_state: torch.Tensor | None,
    recurrent_state: torch.Tensor | None,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    activation: str | None,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gdn_decode_step``'s input checks; returns the 2-D conv weight and the conv state's last ``kernel_size - 1``
    columns."""
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported activation {activation!r}; use one of {sorted(map(str, _ACTIVATIONS))}"
        )
    if mixed_qkv.dim() != 3 or mixed_qkv.shape[1] != 1:
        raise ValueError(
            f"mixed_qkv must be [B, 1, C] (one token per sequence); got {tuple(mixed_qkv.shape)}"
        )
    B, _, C = mixed_qkv.shape
    Hk, Dk, Dv = int(num_k_heads), int(head_k_dim), int(head_v_dim)
    for name, t in (("a", a), ("b", b)):
        if t.shape != (B, 1, Hv):
            raise ValueError(f"{name} must be [B, 1, Hv] = {(B, 1, Hv)}; got {tuple(t.shape)}")
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the q/k heads ({Hk})")
    if C != 2 * Hk * Dk + Hv * Dv:
        raise ValueError(f"mixed_qkv has {C} channels; 2 * Hk * Dk + Hv * Dv = {2 * Hk * Dk + Hv * Dv}")
    weight = conv_weight.squeeze(1) if conv_weight.dim() == 3 else conv_weight
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"conv_weight must be [C={C}, kernel_size >= 2]; got {tuple(conv_weight.shape)}")
    ks = weight.shape[1]
    if conv_bias is not None and conv_bias.shape != (C,):
        raise ValueError(f"conv_bias must be [{C}]; got {tuple(conv_bias.shape)}")
    if dt_bias.numel() != Hv:
        raise ValueError(f"dt_bias must have Hv = {Hv} elements like A_log; got {tuple(dt_bias.shape)}")
    if conv_state is not None:
        if conv_state.dim() != 3 or conv_state.shape[:2] != (B, C) or conv_state.shape[2] < ks - 1:
            raise ValueError(
                f"conv_state must be [B, C, W >= kernel_size - 1] = [{B}, {C}, >= {ks - 1}]; "
                f"got {tuple(conv_state.shape)}"
            )
        if conv_state.shape[2] != ks - 1:
            if in_place:
                raise ValueError(f"in_place needs conv_state of width kernel_size - 1 = {ks - 1}")
            conv_state = conv_state[..., conv_state.shape[2] - (ks - 1) :]
    if recurrent_state is not None:
        if recurrent_state.shape != (B, Hv, Dk, Dv) or recurrent_state.dtype != torch.float32:
            raise ValueError(
                f"recurrent_state must be fp32 [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}; got "
                f"{recurrent_state.dtype} {tuple(recurrent_state.shape)}"
            )
    if in_place:
        for name, t in (("conv_state", conv_state), ("recurrent_state", recurrent_state)):
            if t is None or not t.is_contiguous():
                raise ValueError(f"in_place needs {name} given and contiguous (its own storage per element)")
    return weight, conv_state


def gdn_decode_step(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor | None,
    recurrent_state: torch.Tensor | None,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    activation: str | None = "silu",
    scale: float | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per sequence through a Gated DeltaNet layer's conv and delta rule (no autograd).

    Args:
        mixed_qkv: ``[B, 1, C]`` pre-conv projections, ``C = 2 * Hk * Dk + Hv * Dv`` (q, k, v channels).
        a, b: ``[B, 1, Hv]`` raw decay and write-strength projections.
        conv_weight: ``[C, kernel_size]`` (or ``nn.Conv1d``'s ``[C, 1, kernel_size]``); conv_bias ``[C]`` or None.
        A_log, dt_bias: ``[Hv]``: ``g = -exp(A_log) * softplus(a + dt_bias)`` in fp32.
        conv_state: ``[B, C, W]`` with ``W >= kernel_size - 1`` (its last ``kernel_size - 1`` columns, newest
            last, are read), or None (zeros: the start of the sequence). May be a stride-0 expanded view unless
            ``in_place``.
        recurrent_state: ``[B, Hv, Dk, Dv]`` fp32, or None (zeros).
        num_k_heads, head_k_dim, head_v_dim: ``Hk``, ``Dk``, ``Dv`` (``Hv = A_log.numel()``, a multiple of ``Hk``).
        activation: the conv's activation, ``"silu"`` / ``"swish"`` or None / ``"identity"``.
        scale: query scale after the L2 norm, default ``Dk ** -0.5``.
        in_place: write the new states into ``conv_state`` (width exactly ``kernel_size - 1``) and
            ``recurrent_state`` (both given, contiguous) and return them; otherwise return new tensors and
            leave the inputs untouched.
    Returns:
        ``(core [B, 1, Hv, Dv] in mixed_qkv's dtype, conv state [B, C, kernel_size - 1], recurrent state fp32)``.
    """
    weight, conv_state = _checked_inputs(
        mixed_qkv,
        a,
        b,
        conv_weight,
        conv_bias,
        dt_bias,
        A_log.numel(),
        conv_state,
        recurrent_state,
        num_k_heads=num_k_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        activation=activation,
        in_place=in_place,
    )
    B, _, C = mixed_qkv.shape
    Hv, ks = A_log.numel(), weight.shape[1]
    Hk, Dk, Dv = int(num_k_heads), int(head_k_dim), int(head_v_dim)
    triton, conv_kernel, delta_kernel = _kernels()
    device, dtype = mixed_qkv.device, mixed_qkv.dtype
    new_conv = conv_state if in_place else torch.empty(B, C, ks - 1, dtype=dtype, device=device)
    new_rec = recurrent_state if in_place else torch.empty(B, Hv, Dk, Dv, dtype=torch.float32, device=device)
    y = torch.empty(B, C, dtype=dtype, device=device)
    core = torch.empty(B, 1, Hv, Dv, dtype=dtype, device=device)
    s0 = conv_state if conv_state is not None else new_conv  # unread without a state
    h0 = recurrent_state if recurrent_state is not None else new_rec
    _launch_conv(conv_kernel, triton, mixed_qkv, weight, conv_bias, conv_state, s0, new_conv, y, activation)
    _launch_delta(
        delta_kernel, triton, y, a, b, A_log, dt_bias, recurrent_state, h0, new_rec, core, scale, Hk
    )
    return core, new_conv, new_rec


def _launch_conv(
    conv_kernel, triton, mixed_qkv, weight, conv_bias, conv_state, s0, new_conv, y, activation
) -> None:
    """The causal conv's one step: ``y`` and the shifted conv state ``new_conv``."""
    B, _, C = mixed_qkv.shape
    conv_kernel[(B, triton.cdiv(C, _BLOCK_C))](
        mixed_qkv,
        mixed_qkv.stride(0),
        mixed_qkv.stride(2),
        weight,
        weight.stride(0),
        weight.stride(1),
        conv_bias if conv_bias is not None else weight,
        s0,
        *s0.stride(),
        new_conv,
        *new_conv.stride(),
        y,
        C,
        KS=weight.shape[1],
        HAS_BIAS=conv_bias is not None,
        HAS_STATE=conv_state is not None,
        SILU=activation in ("silu", "swish"),
        BLOCK_C=_BLOCK_C,
        num_warps=4,
    )


def _launch_delta(
    delta_kernel, triton, y, a, b, A_log, dt_bias, recurrent_state, h0, new_rec, core, scale, Hk
) -> None:
    """The delta rule's one step: ``core`` and the new recurrent state ``new_rec``."""
    B, Hv, Dk, Dv = new_rec.shape
    C = y.shape[1]
    BV = min(_BLOCK_V, triton.next_power_of_2(Dv))
    delta_kernel[(B * Hv, triton.cdiv(Dv, BV))](
        y,
        C,
        a,
        a.stride(0),
        a.stride(2),
        b,
        b.stride(0),
        b.stride(2),
        A_log.reshape(Hv),
        dt_bias.reshape(Hv),
        h0,
        *h0.stride(),
        new_rec,
        *new_rec.stride(),
        core,
        float(Dk**-0.5 if scale is None else scale),
        HK=Hk,
        HV=Hv,
        DK=Dk,
        DV=Dv,
        BK=triton.next_power_of_2(Dk),
        BV=BV,
        HAS_STATE=recurrent_state is not None,
        num_warps=4,
    )
