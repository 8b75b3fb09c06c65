"""Mamba-2's selective state-space scan (the SSD chunked algorithm) continuing from, and returning, a state.

The math of HF's torch path (``mamba2_chunk_scan`` in ``modeling_nemotron_h``, shared by the Mamba-2 hybrids):
``dt = clamp(softplus(dt + dt_bias), *dt_limit)``; per head ``h`` the state ``S [head_dim, N]`` decays by
``exp(dt * A_h)`` and takes ``dt * x B^T``; the output is ``S C + D_h x``. B and C come in ``n_groups`` groups, each
serving ``num_heads / n_groups`` consecutive heads (HF's ``repeat_interleave``). Everything is computed in fp32;
the returned state is fp32 (HF's ``mamba_ssm_cache_dtype``).

Unlike HF's function, the chunk is at most the call's length (a decode token is one chunk of one, not one padded to
128), and the initial state is a constant unless ``state_grad`` (the full gradient: a boundary state as a leaf).
Chunking changes only the rounding: the state at a chunk boundary is exact, so a prompt captured in any chunks and a
full forward agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["mamba2_scan"]


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j + 1 : i + 1])`` for ``j <= i``, ``-inf`` above the diagonal (HF's
    ``segment_sum``: cumulative sums of masked copies, stable where direct differences are not)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device)), -torch.inf)


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2's scan of ``T`` tokens from ``initial_state``.

    Args:
        x: ``[b, T, H, P]`` (the conv's output, split per head).
        dt: ``[b, T, H]`` before ``dt_bias`` and the softplus.
        A: ``[H]`` (``-exp(A_log)``), D, dt_bias: ``[H]``.
        B, C: ``[b, T, G, N]``.
        chunk_size: tokens per SSD chunk (the model's ``chunk_size``; at most ``T`` are used).
        dt_limit: the clamp on the discretised ``dt`` (HF's ``time_step_limit``).
        initial_state: ``[b, H, P, N]`` fp32 or None (zeros). A constant (detached) unless ``state_grad``.
        output_final_state: also return the state after the ``T`` tokens.
    Returns:
        ``(y [b, T, H, P] fp32, final state [b, H, P, N] fp32 or None)``.
    """
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if initial_state is not None and not state_grad:
        initial_state = initial_state.detach()
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = x.float()
    B = B.float().repeat_interleave(h // g, dim=2, output_size=h)
    C = C.float().repeat_interleave(h // g, dim=2, output_size=h)
    d_residual = D.float()[:, None] * x
    if t == 0:
        state = initial_state.float() if initial_state is not None else x.new_zeros(b, h, p, n)
        return x.new_zeros(b, 0, h, p), state if output_final_state else None

    chunk = max(1, min(chunk_size, t))
    pad = (chunk - t % chunk) % chunk
    xdt = x * dt[..., None]
    a = A.float() * dt  # [b, T, H]: log decay of each token

    def chunks(v):  # [b, T, ...] -> [b, c, l, ...], zero-padded (padded tokens: no input, decay exp(0) = 1)
        v = F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad))
        return v.reshape(b, -1, chunk, *v.shape[2:])

    xdt, a, B, C = chunks(xdt), chunks(a), chunks(B), chunks(C)
    a = a.permute(0, 3, 1, 2)  # [b, H, c, l]
    a_cumsum = torch.cumsum(a, dim=-1)

    # 1. within each chunk (the diagonal blocks): attention-like scores C B^T under the causal decay
    decay = torch.exp(_segment_sum(a))  # [b, H, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xdt)

    # 2. each chunk's own contribution to the state at its end
    decay_states = torch.exp(a_cumsum[..., -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, xdt)

    # 3. the states at the chunk boundaries, from the initial state through every chunk
    if initial_state is None:
        previous = torch.zeros_like(states[:, :1])
    else:
        previous = initial_state[:, None].to(dtype=states.dtype, device=states.device)
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[..., -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]

    # 4. the states' contribution to each chunk's outputs
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(a_cumsum))
    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :t] + d_residual
    return y, final if output_final_state else None
