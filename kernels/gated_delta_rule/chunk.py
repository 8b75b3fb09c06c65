"""Gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers) for capture and replay.

* :func:`chunk_gated_delta_rule_torch`: the chunked (WY / UT-transform) algorithm of HF's
  ``torch_chunk_gated_delta_rule``, same conventions, but processed in blocks of chunks so a long no-grad
  prefill never holds more than one block of intermediates, and a response replayed under autograd can
  recompute each block in backward (``checkpoint``) instead of keeping all of its intermediates.
  The initial state is a constant: it is detached, never written, and gets no gradient.
* :func:`gated_delta_step`: one token without autograd (decoding), fixed shapes, CUDA-graph safe.
* :func:`gated_delta_rule`: dispatcher (one graph-free token: the step). flash-linear-attention on CUDA for
  graph-free calls and for calls that need backward: fla's chunked backward with our torch ``chunk_bwd_dqkwg``
  (``chunk_backward.py``, registered as an fla backend) in place of the one fla kernel refused on Hopper
  with Triton 3.4-3.7.0 (``LONGSTRAW_DISABLE=gdn_backward``: the torch chunked rule;
  ``LONGSTRAW_DISABLE=torch_dqkwg``: fla's own kernel where its Triton allows it); the torch chunked rule otherwise.

Layouts (HF and fla agree): q, k ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; g (log decay, <= 0) and beta
``[B, T, Hv]``; states ``[B, Hv, K, V]`` in fp32. ``Hv`` may be a multiple of ``Hk`` (grouped value
heads): q/k head ``i`` serves value heads ``i * Hv // Hk ... (i + 1) * Hv // Hk - 1`` (HF's
``repeat_interleave``). Queries are scaled by ``scale`` (default ``K ** -0.5``) after the optional L2 norm.
The output has q's dtype; the final state is fp32.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..runtime.autotune import pin_autotune_choices
from ..runtime.switches import DISABLE_ENV, enabled
from .chunk_backward import chunk_bwd_dqkwg_torch
from .naive import l2norm

__all__ = [
    "chunk_gated_delta_rule_torch",
    "fla_available",
    "fla_backward_available",
    "fla_chunk_backward_available",
    "gated_delta_rule",
    "gated_delta_step",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 2048  # tokens per block of chunks (a multiple of chunk_size is used)
FLA_MAX_TOKENS_PER_CALL = 16384  # fla keeps [B, T/64, H, K, V] per call: split long no-grad calls
TORCH_DQKWG_SWITCH = "torch_dqkwg"  # off: fla's own chunk_bwd_dqkwg where it is not miscompiled
GDN_BACKWARD_SWITCH = "gdn_backward"  # on: fla's chunked backward with our torch chunk_bwd_dqkwg


# ---------------------------------------------------------------------------------------------------------
# torch chunked rule
# ---------------------------------------------------------------------------------------------------------
def _check_shapes(q, k, v, g, beta, initial_state):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, Hk, K = k.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, Hv, V] with B={B}, T={T}; got {tuple(v.shape)}")
    Hv, V = v.shape[-2:]
    if Hv % Hk != 0:
        raise ValueError(f"the number of value heads ({Hv}) must be a multiple of the q/k heads ({Hk})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = {(B, T, Hv)}; got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (B, Hv, K, V):
        raise ValueError(
            f"initial_state must be [B, Hv, K, V] = {(B, Hv, K, V)}; got {tuple(initial_state.shape)}"
        )
    return B, T, Hk, K, Hv, V


def _gdr_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    use_qk_l2norm_in_kernel: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of tokens (any length) from ``state`` (fp32 ``[B, Hv, K, V]``).

    Returns the block output ``[B, Tb, Hv, V]`` (fp32) and the state after the block. No in-place
    writes into anything autograd saved, so it can run under autograd or inside ``checkpoint``.
    """
    B, Tb, Hk, _ = k.shape
    Hv = v.shape[2]
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    # [B, H, Tb, D] / [B, H, Tb], fp32
    q, k, v = (x.transpose(1, 2).to(torch.float32) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).to(torch.float32) for x in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    C = chunk_size
    pad = (-Tb) % C
    if pad:
        # zero padding is inert: beta = 0 writes nothing, g = 0 decays nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (Tb + pad) // C
    q, k, v = (x.reshape(B, Hv, N, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, Hv, N, C), beta.reshape(B, Hv, N, C)

    cum = g.cumsum(-1)  # log of the decay from the chunk start to each position (inclusive)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_t = k.transpose(-1, -2)
    k_beta = k * beta.unsqueeze(-1)
    # UT transform: (I + strictly_lower(diag(beta) K K^T * decay))^-1 applied to beta*V and beta*K*exp(cum)
    ut = (k_beta @ k_t) * decay
    u = torch.linalg.solve_triangular(ut, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    del ut, k_beta
    attn = (q @ k_t) * decay  # intra-chunk scores, diagonal included
    del decay, k_t
    q_dec = q * cum.exp().unsqueeze(-1)  # reads the state at the chunk start
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes into the state at the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    outs = []
    for i in range(N):
        v_new = u[:, :, i] - w[:, :, i] @ state  # the part of the values the state does not predict
        outs.append(q_dec[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, Hv, N * C, -1)[:, :, :Tb]
    return o.transpose(1, 2), state


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    scale: float | None = None,
    block_size: int | None = None,
    checkpoint: bool | None = None,
    state_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule in torch; HF ``torch_chunk_gated_delta_rule`` semantics.

    Note the argument order differs from HF's (``chunk_size`` comes 6th there) and follows fla's
    ``chunk_gated_delta_rule``: pass everything after ``beta`` by keyword.

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]``; g, beta: ``[B, T, Hv]`` (any float dtypes;
            computed in fp32 like HF).
        initial_state: ``[B, Hv, K, V]`` or None. A constant (detached) unless ``state_grad``; never
            written in place.
        output_final_state: return the fp32 state after the last token (a fresh tensor).
        chunk_size: tokens per UT-transform chunk (64 like HF and fla).
        use_qk_l2norm_in_kernel: L2-normalize q and k (eps 1e-6, in fp32) before scaling q.
        scale: query scale, default ``K ** -0.5``.
        block_size: tokens per block (rounded up to a multiple of ``chunk_size``; default 2048). Memory
            of the intermediates is bounded by one block; the state is carried between blocks.
        checkpoint: when gradients are needed, recompute each block in backward and keep only its
            inputs and its start state (like fla keeps per-chunk states). Default (None): on when the
            call spans more than one block. Forced off when no gradient is needed.
        state_grad: the initial state is differentiable (the full gradient: a boundary state as a leaf),
            and so is the final state whenever autograd is on.
    Returns:
        ``(o [B, T, Hv, V] in q.dtype, final_state fp32 [B, Hv, K, V] or None)``.
    """
    B, T, Hk, K, Hv, V = _check_shapes(q, k, v, g, beta, initial_state)
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else float(scale)
    block = block_size or DEFAULT_BLOCK_SIZE
    block = max(chunk_size, -(-block // chunk_size) * chunk_size)

    if initial_state is None:
        state = torch.zeros(B, Hv, K, V, dtype=torch.float32, device=q.device)
    elif state_grad:
        state = initial_state.to(device=q.device, dtype=torch.float32)
    else:
        state = initial_state.detach().to(device=q.device, dtype=torch.float32)

    inputs = (q, k, v, g, beta) + ((state,) if state_grad and initial_state is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    use_ckpt = needs_grad and (T > block if checkpoint is None else bool(checkpoint))

    starts = range(0, T, block)
    if needs_grad:
        outs = []
        for s in starts:
            args = (q[:, s : s + block], k[:, s : s + block], v[:, s : s + block])
            args += (g[:, s : s + block], beta[:, s : s + block], state)
            extra = (chunk_size, use_qk_l2norm_in_kernel, scale)
            if use_ckpt:
                o_b, state = _checkpoint(_gdr_block, *args, *extra, use_reentrant=False)
            else:
                o_b, state = _gdr_block(*args, *extra)
            outs.append(o_b.to(out_dtype))
        o = torch.cat(outs, dim=1) if outs else v.new_zeros(B, 0, Hv, V, dtype=out_dtype)
    else:
        # graph-free (e.g. a long prefill chunk): write each block into one preallocated output
        o = torch.empty(B, T, Hv, V, dtype=out_dtype, device=q.device)
        for s in starts:
            e = min(T, s + block)
            o_b, state = _gdr_block(
                q[:, s:e],
                k[:, s:e],
                v[:, s:e],
                g[:, s:e],
                beta[:, s:e],
                state,
                chunk_size,
                use_qk_l2norm_in_kernel,
                scale,
            )
            o[:, s:e] = o_b
            del o_b

    if not output_final_state:
        return o, None
    if T == 0 and initial_state is not None:
        state = state.clone()  # never hand back the caller's own tensor as a "new" state
    return o, state


# ---------------------------------------------------------------------------------------------------------
# flash-linear-attention
# ---------------------------------------------------------------------------------------------------------
@functools.cache
def _fla_chunk_fn():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no triton / no GPU build
        return None
    pin_autotune_choices()  # fla's kernels exist now: this GPU's measured choices spare a fresh machine the tuning
    return chunk_gated_delta_rule


@functools.cache
def _fla_native_gva() -> bool:
    """fla >= 0.6 maps value head ``i`` to q/k head ``i // (HV // H)`` in-kernel (same as repeat_interleave)."""
    try:
        import fla

        return _version_tuple(fla.__version__) >= (0, 6, 0)
    except Exception:
        return False


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def fla_available() -> bool:
    """True when ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` imports."""
    return _fla_chunk_fn() is not None


def _triton_version() -> tuple[int, ...] | None:
    try:
        import triton
    except Exception:
        return None
    return _version_tuple(triton.__version__)


def _fla_dqkwg_miscompiled(device: torch.device | None = None) -> bool:
    """Hopper (sm_90) with ``3.4.0 <= Triton < 3.7.1``: fla's own gated ``chunk_bwd_dqkwg`` raises there (a
    Triton miscompile gives wrong gradients,
    https://github.com/fla-org/flash-linear-attention/issues/640; guard relaxed in
    https://github.com/fla-org/flash-linear-attention/pull/983)."""
    tv = _triton_version()
    major, _ = torch.cuda.get_device_capability(device)
    return tv is not None and major == 9 and (3, 4, 0) <= tv < (3, 7, 1)


def fla_backward_available(device: torch.device | None = None) -> bool:
    """May fla's chunked backward run on its own kernels only? Conservative: only with
    ``LONGSTRAW_DISABLE=torch_dqkwg``, and never where fla's gated ``chunk_bwd_dqkwg`` is miscompiled (Hopper,
    ``3.4.0 <= Triton < 3.7.1``). Otherwise a call that needs backward takes :func:`fla_chunk_backward_available`'s
    path (fla with our torch ``chunk_bwd_dqkwg``) or the torch chunked rule.
    """
    if enabled(TORCH_DQKWG_SWITCH):
        return False
    if not fla_available() or not torch.cuda.is_available() or _triton_version() is None:
        return False
    if _fla_dqkwg_miscompiled(device):
        logger.info(
            "%s names %s but Triton %s on Hopper is in fla's backward miscompile range [3.4.0, 3.7.1): fla's "
            "gated chunk_bwd_dqkwg is ours (unless %s is named too, then the torch chunked rule serves)",
            DISABLE_ENV,
            TORCH_DQKWG_SWITCH,
            ".".join(map(str, _triton_version())),
            GDN_BACKWARD_SWITCH,
        )
        return False
    return True


def _own_dqkwg_accepts(*args, **kwargs) -> tuple[bool, str | None]:
    """fla backend verifier: the gated, equal-length calls our torch ``chunk_bwd_dqkwg`` serves, unless the user
    asked for fla's own kernel where it is not miscompiled (``LONGSTRAW_DISABLE=torch_dqkwg``)."""
    bound = inspect.signature(chunk_bwd_dqkwg_torch).bind(*args, **kwargs).arguments
    if bound.get("g") is None or bound.get("g_gamma") is not None or bound.get("cu_seqlens") is not None:
        return False, "LongStraw's torch chunk_bwd_dqkwg serves gated, equal-length calls only"
    if fla_backward_available(bound["q"].device):
        return False, f"{DISABLE_ENV} names {TORCH_DQKWG_SWITCH}, outside fla's miscompile range"
    return True, None


@functools.cache
def _register_own_dqkwg() -> bool:
    """Register :func:`chunk_bwd_dqkwg_torch` as an fla backend of ``fla.ops.common.chunk_o.chunk_bwd_dqkwg``
    (fla's ``@dispatch('common')`` registry, tried before fla's Triton kernel). Process-wide and once; it serves
    while the ``gdn_backward`` switch is on. False when fla (or its backend registry) is missing."""
    try:
        from fla.backends import BaseBackend, register
        from fla.ops.common import chunk_o  # noqa: F401 - loads the 'common' registry
    except Exception:  # noqa: BLE001 - no fla, or an fla without backend dispatch: the torch rule serves
        return False
    backend = type(
        "LongStrawDqkwgBackend",
        (BaseBackend,),
        {
            "backend_type": "longstraw_torch",
            "priority": 4,  # before TileLang's (5): the path our tests check; after Ascend's NPU backend (0)
            "is_enabled": lambda self: enabled(GDN_BACKWARD_SWITCH),
            "chunk_bwd_dqkwg": staticmethod(chunk_bwd_dqkwg_torch),
            "chunk_bwd_dqkwg_verifier": staticmethod(_own_dqkwg_accepts),
        },
    )
    register("common")(backend)
    return True


def fla_chunk_backward_available() -> bool:
    """Can a call that needs backward run on fla's chunked forward/backward with our torch ``chunk_bwd_dqkwg``
    in place of fla's guarded Triton kernel? ``gdn_backward`` on (default: not in ``LONGSTRAW_DISABLE``), fla importable with its
    backend registry (the registration happens here, once)."""
    return enabled(GDN_BACKWARD_SWITCH) and fla_available() and _register_own_dqkwg()


def _fla_call(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    output_final_state,
    use_qk_l2norm_in_kernel,
    scale,
    max_tokens,
    state_grad=False,
):
    fn = _fla_chunk_fn()
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv != Hk and not _fla_native_gva():  # older fla: repeat q/k heads (same head mapping)
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    if initial_state is None:
        state = None
    else:  # fla returns the initial state's gradient when it requires one
        state = (initial_state if state_grad else initial_state.detach()).to(torch.float32)
    T = q.shape[1]
    inputs = (q, k, v, g, beta) + ((state,) if state is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if needs_grad:
        fla_chunk_backward_available()  # registers our chunk_bwd_dqkwg (if switched on) before fla's backward runs
    if needs_grad or T <= max_tokens:
        o, final = fn(
            q,
            k,
            v,
            g.to(torch.float32),
            beta,
            scale=scale,
            initial_state=state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        return o, (final if output_final_state else None)
    # graph-free long call: split so fla's per-chunk states [B, T/64, H, K, V] stay bounded
    o = torch.empty(*v.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    for s in range(0, T, max_tokens):
        e = min(T, s + max_tokens)
        o_b, state = fn(
            q[:, s:e],
            k[:, s:e],
            v[:, s:e],
            g[:, s:e].to(torch.float32),
            beta[:, s:e],
            scale=scale,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        o[:, s:e] = o_b
        del o_b
    return o, (state if output_final_state else None)


# ---------------------------------------------------------------------------------------------------------
# one decode step
# ---------------------------------------------------------------------------------------------------------
def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for one token (``T == 1``: decoding), without autograd: a handful of batched ops with
    fixed shapes and no host synchronisation (CUDA-graph safe), instead of a chunked kernel padded to 64.

    Shapes as :func:`chunk_gated_delta_rule_torch`; returns ``(o [B, 1, Hv, V] in q.dtype, state fp32)``.
    Grouped value heads are served by viewing, not repeating, the q/k heads.
    """
    B, T, Hk, K = k.shape
    Hv, V = v.shape[-2:]
    if T != 1:
        raise ValueError(f"gated_delta_step takes one token, got T={T}")
    rep = Hv // Hk
    qf, kf = q[:, 0].float(), k[:, 0].float()  # [B, Hk, K]
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (K**-0.5 if scale is None else scale)
    if initial_state is None:
        S = q.new_zeros(B, Hk, rep, K, V, dtype=torch.float32)
    else:
        S = initial_state.detach().float().reshape(B, Hk, rep, K, V)
    S = S * g[:, 0].float().exp().reshape(B, Hk, rep, 1, 1)
    pred = torch.einsum("bhrkv,bhk->bhrv", S, kf)  # S^T k
    delta = (v[:, 0].float().reshape(B, Hk, rep, V) - pred) * beta[:, 0].float().reshape(B, Hk, rep, 1)
    S = S + kf[:, :, None, :, None] * delta[:, :, :, None, :]
    o = torch.einsum("bhrkv,bhk->bhrv", S, qf)
    return o.reshape(B, 1, Hv, V).to(q.dtype), S.reshape(B, Hv, K, V)


# ---------------------------------------------------------------------------------------------------------
# dispatcher
# ---------------------------------------------------------------------------------------------------------
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    block_size: int | None = None,
    checkpoint: bool | None = None,
    fla_max_tokens_per_call: int = FLA_MAX_TOKENS_PER_CALL,
    state_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule from a constant ``initial_state`` (a differentiable one with ``state_grad``, see
    :func:`chunk_gated_delta_rule_torch`); picks fla or the torch chunked rule.

    ``backend``: ``"auto"`` (fla on CUDA for bf16/fp16 inputs when no gradient is needed, or when
    :func:`fla_backward_available` or :func:`fla_chunk_backward_available`; torch otherwise), ``"fla"`` (force; raises
    if unavailable), ``"torch"``. Shapes and returns as :func:`chunk_gated_delta_rule_torch`. The initial state is
    never written, and gets a gradient only with ``state_grad`` (both paths).
    """
    _, T, _, K, _, _ = _check_shapes(q, k, v, g, beta, initial_state)
    if backend not in ("auto", "fla", "torch"):
        raise ValueError(f"backend must be 'auto', 'fla' or 'torch'; got {backend!r}")
    scale = K**-0.5 if scale is None else float(scale)
    grad_inputs = (q, k, v, g, beta) + ((initial_state,) if state_grad and initial_state is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in grad_inputs)
    if backend == "auto" and T == 1 and not needs_grad:
        o, final = gated_delta_step(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, scale)
        return o, (final if output_final_state else None)
    use_fla = backend == "fla"
    if backend == "auto":
        use_fla = (
            q.is_cuda
            and chunk_size == 64
            and q.dtype in (torch.bfloat16, torch.float16)
            and q.dtype == k.dtype == v.dtype
            and fla_available()
            and (not needs_grad or fla_backward_available(q.device) or fla_chunk_backward_available())
        )
    if use_fla:
        if not fla_available():
            raise RuntimeError("backend='fla' but flash-linear-attention (fla) is not importable")
        return _fla_call(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            scale,
            fla_max_tokens_per_call,
            state_grad,
        )
    return chunk_gated_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        scale=scale,
        block_size=block_size,
        checkpoint=checkpoint,
        state_grad=state_grad,
    )
