"""Exact attention of response (or prompt-chunk) queries over read-only prompt pages plus their own causal keys.

The two key sets are disjoint: each part yields ``(out, lse)`` (:mod:`.sdpa`) and they merge exactly by log-sum-exp
(:mod:`.merge`). The backward of a part needs only the *final* ``out`` and ``lse`` (the FlashAttention identity), so
the prompt part, whose keys are constants, computes dQ only (:func:`pages_attention_dq`, by the prompt-page dQ kernel
where it serves), unless the full gradient asks for the pages' dK/dV too.

Layouts: queries ``[B, Hq, T, D]``; response keys/values ``[B, Hkv, T, D]``; prompt pages ``[Hkv, L, D]`` shared by
the whole batch. Grouped-query heads are folded into the query axis for the prompt part (no mask there, so the
``Hq / Hkv`` query heads of one group are just more rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..runtime.switches import enabled
from .merge import fold_gqa, merge_partials, merge_sink, repeat_kv, unfold_gqa
from .prompt_dq import prompt_dq, prompt_dq_available
from .sdpa import attention_grads, attention_lse


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


# () -> (k, v) pages ``[Hkv, L, D]`` on the queries' device, in order
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
        if sink is None and softcap is None and _use_prompt_dq() and prompt_dq_available(qf, k):
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


def _self_attention_lse(q, k, v, scale, softcap=None):
    rep = q.shape[1] // k.shape[1]
    return attention_lse(q, repeat_kv(k, rep), repeat_kv(v, rep), scale, causal=True, softcap=softcap)


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
