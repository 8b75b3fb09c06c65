"""DeepSeek Sparse Attention (DSA) math: the indexer's top-k choice and attention over chosen keys.

Indexer: query ``i`` scores key ``j`` as ``sum_h w_ih * relu(scale * q_ih . k_j)`` (HF's
``GlmMoeDsaIndexer``, fp32), and keeps the ``topk`` best causally visible keys. Scores are computed in tiles
of queries and keys and merged into a running top-k (:func:`topk_merge`), so no ``[T, L]`` score matrix of
the whole prompt exists at once.

Attention: each query attends only to the keys it chose. Keys are rows of a table (one shared by the batch:
the prompt's MLA latent; or one per sequence: the response's own latent), chosen by ``rows [B, T, k]`` (-1:
no key). The value is the first ``value_dim`` columns of the key (MLA in latent space: key ``[c_kv, k_rot]``,
value ``c_kv``). Each part returns ``(out, lse)`` and parts merge exactly by log-sum-exp
(:func:`kernels.attention.merge_partials`). The prompt part's table is a constant: its backward
(:class:`SelectedKeysAttention`) gives dQ only, from the final merged ``out``/``lse`` of that part, and
re-reads the table through a callable (so an offloaded table is streamed again instead of kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .indexer import index_scores, index_scores_kernel_available
from .naive import matmul_fp32
from .selected_keys import selected_attention_kernel, selected_attention_kernel_available

# One fp32 score tile (queries x heads x keys) stays under this many elements (1 GiB).
SCORE_TILE_ELEMENTS = 1 << 28
# Query rows (batch x queries) per block of the selected-keys attention; the gathered keys of a block are
# ``rows x topk x D`` elements.
ATTENTION_QUERY_ROWS = 256
# A per-sequence table (a response's own keys) of at most this many rows per chosen key is attended densely
# with a mask (:func:`masked_attention_block`): its scores cost at most twice the gathered ones'.
DENSE_ROWS_PER_CHOICE = 2


def _topk_of_buffer(
    buf: torch.Tensor, kept: int, best_pos: torch.Tensor | None, pos: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best scores of ``buf [B, T, kept + n]`` and their positions: its first ``kept`` columns are a
    running top-k (positions ``best_pos [B, T, kept]``), the rest new candidates (positions ``pos``,
    broadcastable to ``[B, T, n]``). Unsorted (the selection is a set); positions are gathered, never
    concatenated (a capture's merge would otherwise write 8 bytes per candidate)."""
    top, i = buf.topk(min(k, buf.shape[-1]), dim=-1, sorted=False)
    if kept == buf.shape[-1]:  # no candidates
        return top, best_pos.gather(-1, i)
    pos = pos.expand(*buf.shape[:-1], buf.shape[-1] - kept)
    new = pos.gather(-1, (i - kept).clamp_min(0))
    if not kept:
        return top, new
    return top, torch.where(i < kept, best_pos.gather(-1, i.clamp_max(kept - 1)), new)


def topk_merge(
    best: torch.Tensor | None,
    best_pos: torch.Tensor | None,
    scores: torch.Tensor,
    pos: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of a running top-k ``(best, best_pos) [B, T, k']`` and new candidates ``(scores, pos)``
    (``pos [B, T, L]`` or ``[L]``); masked candidates carry ``-inf``."""
    if best is None:
        return _topk_of_buffer(scores, 0, None, pos, k)
    return _topk_of_buffer(torch.cat([best, scores], -1), best.shape[-1], best_pos, pos, k)


# Scores (queries x keys, fp32) gathered into one buffer before a top-k merge: fewer, larger top-k calls
# (512 MiB: 32K keys for a 4096-query block of a capture chunk, all of a 2M prompt for 8 decoding rows).
TOPK_BUFFER_ELEMENTS = 1 << 27


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor | None,
    scale: float,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` keys of ``keys [B or 1, L, D]`` (global positions ``key_pos [L]``) for ``q [B, T, H, D]``.

    ``q_pos [T]``: query positions; key ``j`` is visible to query ``i`` iff ``key_pos[j] <= q_pos[i]``
    (``None``: every key is visible, e.g. prompt keys for later queries). Returns ``(scores, positions)``
    ``[B, T, min(k, L)]`` (in no particular order); a slot with no visible key left has score ``-inf``.
    Scores of up to :data:`TOPK_BUFFER_ELEMENTS` keys x queries are written (by the fused kernel,
    :mod:`kernels.sparse_attention.indexer`, in one launch; by the torch path in tiles of at most
    :data:`SCORE_TILE_ELEMENTS` queries x heads x keys) into a buffer behind the running top-k, which is
    merged into it at once.
    """
    b, t, h, _ = q.shape
    n = keys.shape[-2]
    if n == 0:
        return q.new_empty((b, t, 0), dtype=torch.float32), key_pos.new_empty((b, t, 0))
    fused = index_scores_kernel_available(q, keys)
    tq = min(t, max(1, 4096 // b))
    outs_s, outs_p = [], []
    for a in range(0, t, tq):
        e = min(t, a + tq)
        qa, wa = q[:, a:e], weights[:, a:e]
        qp = None if q_pos is None else q_pos[a:e]
        tile = n if fused else max(1, SCORE_TILE_ELEMENTS // (b * (e - a) * h))
        block = max(1, TOPK_BUFFER_ELEMENTS // (b * (e - a)))
        best = best_pos = None
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            kept = 0 if best is None else best.shape[-1]
            buf = torch.empty(b, e - a, kept + s1 - s0, dtype=torch.float32, device=q.device)
            if kept:
                buf[..., :kept] = best
            for c in range(s0, s1, tile):
                c1 = min(s1, c + tile)
                out = buf[..., kept + c - s0 : kept + c1 - s0]
                kp = None if qp is None else key_pos[c:c1]
                index_scores(qa, wa, keys[:, c:c1], scale, out=out, q_pos=qp, key_pos=kp)
            best, best_pos = _topk_of_buffer(buf, kept, best_pos, key_pos[s0:s1], k)
        outs_s.append(best)
        outs_p.append(best_pos)
    return torch.cat(outs_s, 1), torch.cat(outs_p, 1)


# ----------------------------------------------------------------------------------------------------
# Attention over chosen rows of a key table
# ----------------------------------------------------------------------------------------------------
def _gather(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table [N, D]`` (shared) or ``[B, N, D]`` (per sequence), ``rows [B, t, k]`` -> ``[B, t, k, D]``.

    ``index_select`` on the flattened table: its backward is one ``index_add_`` (advanced indexing's is a
    sort-based ``index_put_``, 79% of a GLM-5 slice's replay on the H200 when every query chose the same
    response keys), in the table's dtype: :func:`selected_attention` passes a half table that needs a
    gradient as one fp32 copy, so the many contributions to one row sum in fp32."""
    safe = rows.clamp_min(0)
    n, d = table.shape[-2:]
    if n == 0:  # nothing stored here (a rank without pages yet): every row is -1
        table, n = table.new_zeros((*table.shape[:-2], 1, d)), 1
    if table.dim() == 3:  # row b * N + j of the flattened per-sequence table
        safe = safe + n * torch.arange(rows.shape[0], device=rows.device).view(-1, 1, 1)
    return table.reshape(-1, d).index_select(0, safe.reshape(-1)).view(*rows.shape, d)


def _rows_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``einsum("bhtk,btkr->bhtr", a, b)`` in fp32: per query, its heads' rows ``a`` times the query's own
    ``b``. With a half ``b`` (bf16 latent rows), ``a`` is rounded to that dtype and the product is a tensor-core
    GEMM with fp32 accumulation and output (HF's attention rounds its probabilities to the activation dtype
    too); fp32 math otherwise (the CPU tests)."""
    return matmul_fp32(a.transpose(1, 2).to(b.dtype), b).transpose(1, 2)  # [B, t, H, k] @ [B, t, k, r]


def _masked_softmax(s: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised probabilities ``p`` of fp32 scores ``s [B, H, t, n]`` over the ``valid`` keys, their sum
    (1 where a query has none) and ``lse`` (``-inf`` there)."""
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()  # (lse does not depend on m)
    p = torch.exp(s - m.unsqueeze(-1))
    total = p.sum(-1)
    has = total > 0
    total = torch.where(has, total, torch.ones_like(total))
    return p, total, torch.where(has, m + torch.log(total), float("-inf"))


def selected_attention_block(
    q: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    value_dim: int,
    row_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, t, D]`` over its chosen rows ``rows [B, t, k]`` of ``table``: ``(out [B, H, t, Dv], lse
    [B, H, t])`` fp32. Scores in the inputs' dtype (as HF's eager attention), softmax in fp32. A query with
    no chosen row gets ``out = 0, lse = -inf``. Differentiable (autograd) in ``q`` and ``table``.
    ``row_dtype``: the dtype the gathered rows are computed in (default the table's; an fp32 copy of a half
    table, made once by :func:`selected_attention` so its gradient sums in fp32, passes the half dtype)."""
    kg = _gather(table, rows).to(row_dtype or table.dtype)  # [B, t, k, D]: fp32 gradient rows, half values
    s = torch.einsum("bhtd,btkd->bhtk", q, kg.to(q.dtype)).float() * scale
    p, total, lse = _masked_softmax(s, (rows >= 0).unsqueeze(1))
    return _rows_matmul(p, kg[..., :value_dim]) / total.unsqueeze(-1), lse


def masked_attention_block(
    q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, scale: float, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selected_attention_block` for a per-sequence ``table [B, N, D]`` with few rows (a response's own
    keys): dense scores over all ``N`` rows, the unchosen masked. Two GEMMs and no gather (nor its backward)."""
    b, h, t, _ = q.shape
    n = table.shape[1]
    chosen = torch.zeros(b, t, n + 1, dtype=torch.bool, device=rows.device)
    chosen = chosen.scatter(-1, rows + 1, True)[..., 1:]  # row -1 (none) lands in the dropped column 0
    # heads folded into the GEMM rows ([B, H t, .] against the table's [B, N, .]): a matmul broadcasting the
    # table over the heads would first copy it once a head
    s = torch.bmm(q.reshape(b, h * t, -1), table.to(q.dtype).transpose(1, 2)).view(b, h, t, n).float() * scale
    p, total, lse = _masked_softmax(s, chosen.unsqueeze(1))
    out = matmul_fp32(p.to(table.dtype).view(b, h * t, n), table[..., :value_dim]).view(b, h, t, value_dim)
    return out / total.unsqueeze(-1), lse


def selected_attention(
    q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, scale: float, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selected_attention_block` in blocks of queries; under autograd each block is checkpointed
    (its gathered keys are gathered again in backward instead of kept). A per-sequence table of at most
    :data:`DENSE_ROWS_PER_CHOICE` times as many rows as each query chooses takes
    :func:`masked_attention_block` (the same result; dense scores cost no more than gathered ones there).
    Without a graph on CUDA the gathered form is the fused kernel (:mod:`kernels.sparse_attention.selected_keys`),
    which reads the chosen rows in place instead of gathering them."""
    b, _, t, _ = q.shape
    tq = max(1, ATTENTION_QUERY_ROWS // b)
    grad = torch.is_grad_enabled() and (q.requires_grad or table.requires_grad)
    dense = table.dim() == 3 and table.shape[1] <= DENSE_ROWS_PER_CHOICE * rows.shape[-1]
    if not dense and selected_attention_kernel_available(q, table, rows):
        return selected_attention_kernel(q, table, rows, scale, value_dim)
    block = masked_attention_block if dense else selected_attention_block
    extra = ()
    if not dense and grad and table.requires_grad and table.dtype in (torch.float16, torch.bfloat16):
        extra, table = (table.dtype,), table.float()  # once for all blocks (each would copy it otherwise)
    outs, lses = [], []
    for a in range(0, t, tq):
        args = (q[:, :, a : a + tq], table, rows[:, a : a + tq], scale, value_dim, *extra)
        o, s = checkpoint(block, *args, use_reentrant=False) if grad else block(*args)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def selected_attention_dq(
    q: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    scale: float,
    value_dim: int,
    dtable: torch.Tensor | None = None,
) -> torch.Tensor:
    """dQ (fp32) of a selected-keys part from its ``out``/``lse`` (merged over ranks) and their gradients:
    ``dS_ij = P_ij (dO_i . v_j - dO_i . O_i + dlse_i)``, ``dQ_i = scale * sum_j dS_ij k_j``.

    ``dtable`` (fp32, ``table [N, D]``'s shape; the full gradient): the rows' gradient is added to it, the key's
    ``dK_j = scale * sum_i dS_ij q_i`` on every column and the value's ``dV_j = sum_i P_ij dO_i`` on the first
    ``value_dim`` (a row is both: MLA's latent)."""
    b, _, t, _ = q.shape
    tq = max(1, ATTENTION_QUERY_ROWS // b)
    dq = torch.zeros_like(q, dtype=torch.float32)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    for a in range(0, t, tq):
        e = min(t, a + tq)
        kg = _gather(table, rows[:, a:e])  # the table's dtype: the GEMMs below accumulate in fp32
        valid = (rows[:, a:e] >= 0).unsqueeze(1)
        s = torch.einsum("bhtd,btkd->bhtk", q[:, :, a:e], kg.to(q.dtype)).float() * scale
        p = torch.exp(s - lse_safe[:, :, a:e, None]).masked_fill(~valid, 0.0)
        do = dout[:, :, a:e].float()
        delta = (do * out[:, :, a:e]).sum(-1, keepdim=True)
        dp = _rows_matmul(do, kg[..., :value_dim].transpose(-1, -2))
        ds = p * (dp - delta + dlse[:, :, a:e, None].float())
        dq[:, :, a:e] = _rows_matmul(ds, kg) * scale
        if dtable is not None:
            d_rows = torch.einsum("bhtk,bhtd->btkd", ds, q[:, :, a:e].float()) * scale
            d_rows[..., :value_dim] += torch.einsum("bhtk,bhtv->btkv", p, do)
            d_rows = d_rows * valid[:, 0, :, :, None]  # slots without a row (-1) send nothing
            # (under autocast the einsums above give bf16 rows: they are summed into the fp32 buffer in fp32)
            d_rows = d_rows.reshape(-1, d_rows.shape[-1]).to(dtable.dtype)
            dtable.index_add_(0, rows[:, a:e].clamp_min(0).reshape(-1), d_rows)
    return dq


class SelectedKeysAttention(torch.autograd.Function):
    """The prompt part: ``q`` over chosen rows of a constant table (``table_fn()``, shared by the batch).

    Returns ``(out, lse)`` merged over context-parallel ranks by ``reduce_partial`` (every rank holds some
    rows; the others are -1 here). Backward gives dQ (the table is a constant for autograd), summed over ranks by
    ``reduce_dq``; it calls ``table_fn`` again, so an offloaded table is streamed back, not kept. ``table_grad``
    (the full gradient): backward also hands the table's gradient (fp32 ``[N, D]``, this rank's rows) to it.
    """

    @staticmethod
    def forward(ctx, q, rows, table, table_fn, scale, value_dim, reduce_partial, reduce_dq, table_grad):
        out, lse = selected_attention(q, table, rows, scale, value_dim)
        out, lse = reduce_partial(out, lse, q)
        ctx.save_for_backward(q, rows, out, lse)
        ctx.table_fn, ctx.scale, ctx.value_dim, ctx.reduce_dq = table_fn, scale, value_dim, reduce_dq
        ctx.table_grad = table_grad
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, rows, out, lse = ctx.saved_tensors
        table = ctx.table_fn()
        dtable = None
        if ctx.table_grad is not None:
            dtable = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
        dq = selected_attention_dq(
            q, table, rows, out, lse, dout, dlse, ctx.scale, ctx.value_dim, dtable=dtable
        )
        if dtable is not None:
            ctx.table_grad(dtable)
        dq = ctx.reduce_dq(dq, torch.zeros_like(dq))
        return dq.to(q.dtype), None, None, None, None, None, None, None, None


def prompt_selected_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    table_fn: Callable[[], torch.Tensor],
    scale: float,
    value_dim: int,
    reduce_partial,
    reduce_dq,
    table_grad: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q [B, H, T, D]`` over its chosen rows of the constant ``table [N, D]``
    (differentiable in ``q`` under autograd: :class:`SelectedKeysAttention`; ``table_fn()`` gives the table
    again in backward, so the graph does not keep it). ``table_grad``: where backward hands the table's
    gradient (the full gradient; ``None``: the table is a constant)."""
    if torch.is_grad_enabled() and q.requires_grad:
        return SelectedKeysAttention.apply(
            q, rows, table, table_fn, scale, value_dim, reduce_partial, reduce_dq, table_grad
        )
    out, lse = selected_attention(q, table, rows, scale, value_dim)
    return reduce_partial(out, lse, q)
