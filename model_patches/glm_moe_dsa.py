"""GLM-5 (``glm_moe_dsa``): multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA) and
cross-layer top-k sharing (IndexShare), dense then MoE blocks.

What a layer keeps of the prompt (:class:`DSAPages`, one :class:`KVPages` per layer): the MLA latent
``[c_kv after kv_a_layernorm | k_rot after RoPE]`` (``kv_lora_rank + qk_rope_head_dim`` per token) and, on
``"full"`` indexer layers, the indexer keys (``index_head_dim`` per token). Nothing else: K/V are never
expanded over the prompt.

Attention runs in latent space with absorbed weights, exactly: query head ``h`` becomes
``[W_uk_h^T q_nope_h | q_rot_h]`` (``W_uk``: the K half of ``kv_b_proj``), the key of token ``j`` is its
latent ``[c_j | k_rot_j]`` and its value ``c_j``, so ``q_h . k_hj`` is HF's score and the head's output is
``W_uv_h`` (the V half) applied to the latent-space output. That is multi-query attention with one key
head (key dim 576, value dim 512 at GLM-5's sizes). ``kv_b_proj``'s effective weight is read by applying
the module to an identity, so LoRA on it (with ``lora_dropout=0``) and accelerate hooks apply.

DSA: a ``"full"`` layer's indexer scores every causally visible key (prompt pages, then the call's own
keys), keeps each query's ``index_topk`` best (HF keeps ``min(index_topk, visible)`` visible keys: its
causal mask puts the rest at ``-inf``), and attention runs over the selected keys only, the prompt part and
the response part merged by log-sum-exp (``kernels/sparse_attention/``). The selection
(:class:`DSASelection`) travels to the following ``"shared"`` layers the way HF passes it: as the third
output of the attention, which the decoder stack feeds to the next layer as ``prev_topk_indices``. The
indexer runs without gradient, as in HF. MoE blocks, norms and the router are the stock modules.

Context parallelism: a rank holds its pages of both the latent and the indexer keys; each rank proposes
its local top-k, every rank takes the top-k of all proposals (plus the replicated response keys), attends
over its own selected prompt keys and the partial results merge over ranks. Offload: the pages live in
pinned host memory and each layer's pages are streamed to the device when the layer runs (and again in
backward).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from longstraw_trl.context import CTX_KWARG
from longstraw_trl.errors import LongStrawError
from longstraw_trl.host_memory import host_rows_to_device
from longstraw_trl.kernels.attention import merge_partials
from longstraw_trl.kernels.host_gather import gather_rows_kernel_available
from longstraw_trl.kernels.sparse_attention import (
    indexer_topk,
    prompt_selected_attention,
    selected_attention,
    topk_merge,
)
from longstraw_trl.kernels.sparse_attention.dsa import ATTENTION_QUERY_ROWS
from longstraw_trl.layer_state import KVPages, LayerState

from .base import FamilyPatch

FULL_INDEXER, SHARED_INDEXER = "full", "shared"
MASK_KEY = "indexed_attention"


def _indexer_types(config) -> list[str]:
    """``config.indexer_types`` (GLM-5); every layer ``"full"`` where the config has none (DeepSeek-V3.2)."""
    types = getattr(config, "indexer_types", None) or [FULL_INDEXER] * config.num_hidden_layers
    return list(types)[: config.num_hidden_layers]


class DSAPages(KVPages):
    """One GLM-5 layer's prompt state: MLA latent pages, with the indexer keys alongside on ``"full"`` layers.

    A :class:`KVPages` with one key head whose "keys" are the latent ``[c_kv | k_rot]`` (``head_dim =
    kv_lora_rank + qk_rope_head_dim``) and whose "values" are the indexer keys (``v_head_dim =
    index_head_dim``, or 0 on ``"shared"`` layers), so paging, context-parallel ownership, forks and offload
    streaming are KVPages' own. ``nbytes_by_kind`` reports ``mla`` and ``indexer`` apart.
    """

    kind = "mla"
    # the full gradient: the latent's in the "keys" buffer (the prompt part's backward, `dsa_forward`); the indexer
    # keys get none, as HF runs its indexer under no_grad (no gradient reaches them or the indexer): no buffer
    grad_kind = "buffer"
    grad_values = False

    def nbytes_by_kind(self) -> dict[str, int]:
        n = self.stored_tokens() * self.num_kv_heads * self.dtype.itemsize
        out = {"mla": n * self.head_dim}
        if self.v_head_dim:
            out["indexer"] = n * self.v_head_dim
        return out

    def decode_streams(self, device: torch.device) -> bool:
        """Offloaded, a decode step reads only the latent rows its queries chose, which the GPU gathers from the
        mapped host memory itself (:func:`_prompt_table`), and indexer keys its call copied before its first
        step (:func:`_prompt_indexer_keys`): nothing to stream, unless the pages span several segments (an
        extended state) or the gather kernel does not serve."""
        if not self.offloaded:
            return False
        if len(self.segments) != 1:
            return True
        rows = torch.empty(0, dtype=torch.long, device=device)
        return not gather_rows_kernel_available(self.segments[0][0][0], rows, device)

    @classmethod
    def planned_bytes_by_kind(
        cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2
    ) -> dict[str, int]:
        out = {"mla": (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes * tokens_on_rank}
        if _indexer_types(config)[layer_idx] == FULL_INDEXER:
            out["indexer"] = config.index_head_dim * dtype_bytes * tokens_on_rank
        return out

    @classmethod
    def planned_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        return sum(cls.planned_bytes_by_kind(config, layer_idx, tokens_on_rank, dtype_bytes).values())

    @classmethod
    def planned_grad_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        """The latent's fp32 gradient buffer only (``grad_values`` False: the indexer keys take none)."""
        mla = cls.planned_bytes_by_kind(config, layer_idx, tokens_on_rank, dtype_bytes)["mla"]
        return mla * 4 // dtype_bytes

    @classmethod
    def planned_offload_workspace(
        cls, config, layer_idx: int, tokens_on_rank: int, page_size: int, dtype_bytes: int = 2
    ) -> int:
        """A capture chunk or a replay joins the layer's streamed latent pages into one table
        (:func:`_materialize`): the pages and the joined copy, each the layer's latent bytes, at that moment."""
        return 2 * cls.planned_bytes_by_kind(config, layer_idx, tokens_on_rank, dtype_bytes)["mla"]


@dataclass
class DSASelection:
    """The keys each query of one call attends to: a ``"full"`` layer's top-k, reused by the ``"shared"``
    layers after it within the same call.

    Args:
        prompt_rows: ``[B, T, k]`` rows of this rank's prompt pages (as :func:`_materialize` lays them out);
            -1 where the slot holds no prompt key of this rank.
        self_rows: ``[B, T, k]`` indices into the call's own keys (the response, or the capture chunk, or the
            decode buffer); -1 where the slot holds none.
    """

    prompt_rows: torch.Tensor
    self_rows: torch.Tensor
    _host_rows: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def gather_index(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``prompt_rows`` flattened, where the gather of chosen rows of the offloaded table ``host`` reads it
        (:func:`~longstraw_trl.host_memory.host_rows_to_device`).

        On the device when the GPU gathers from the mapped host memory itself: no host sync. Otherwise on the
        host, copied once (one host sync) and kept: the ``"shared"`` layers after a ``"full"`` one reuse its
        selection, so they gather their own latent rows without another sync, while the device still runs the
        layers queued before them (GLM-5.2: 21 syncs a decode step instead of 78)."""
        flat = self.prompt_rows.reshape(-1)
        if gather_rows_kernel_available(host, flat, device):
            return flat
        if self._host_rows is None:
            self._host_rows = flat.cpu()
        return self._host_rows


def _materialize(layer: DSAPages, device: torch.device, part: int) -> torch.Tensor:
    """This rank's pages of ``layer`` on ``device``, ``part`` 0: the latent ``[N, D]``, 1: the indexer keys
    ``[N, Di]`` (views of a resident single segment; otherwise the segments or streamed pages joined)."""
    pieces = [p[part] for p in layer.stream(device, keys=part == 0, values=part == 1)]
    if not pieces:  # nothing stored on this rank yet
        width = layer.head_dim if part == 0 else layer.v_head_dim
        return torch.empty(0, width, dtype=layer.dtype, device=device)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1))[0]


def _prompt_indexer_keys(layer: DSAPages, ctx, idx: int, device: torch.device) -> torch.Tensor:
    """This rank's prompt indexer keys of layer ``idx`` on ``device``. A decode step scores all of them, so an
    offloaded layer's are copied by a decode call's first step and kept for its later ones
    (``ctx.prompt_copies``): streamed every step they were 268 MB a step at 1M tokens on the GLM-5 slice, none of
    it hidden; kept, they cost the indexer's bytes on the device while the call runs (256 B a token a full
    layer, against the latent's 1,152 B a token every layer, which stays on the host)."""
    if not layer.offloaded:
        return _materialize(layer, device, 1)
    return ctx.prompt_copy(idx, lambda: _materialize(layer, device, 1))


def _prompt_table(
    layer: DSAPages, sel: DSASelection, device: torch.device, decoding: bool, whole: bool = False
):
    """The prompt part's key table, the rows of it each query chose, and how to get the table again.

    Offloaded, when decoding (G queries x top-k slots; a decode step streams no pages, so that it can be one
    CUDA graph: :meth:`DSAPages.decode_streams`) or with fewer chosen slots than stored tokens: only the chosen
    rows reach the device (:meth:`DSASelection.gather_index`); otherwise, or with ``whole`` (the full gradient,
    whose rows index the pages), this rank's pages (:func:`_materialize`).
    """
    rows = sel.prompt_rows
    few = not whole and (decoding or rows.numel() < layer.stored_tokens())
    if layer.offloaded and len(layer.segments) == 1 and few:
        host = layer.segments[0][0][0]
        flat = sel.gather_index(host, device)

        def table():
            return host_rows_to_device(host, flat, device)

        slots = torch.arange(rows.numel(), device=rows.device).view_as(rows)
        return table(), torch.where(rows >= 0, slots, rows), table

    def pages():
        return _materialize(layer, device, 0)

    return pages(), rows, pages


def _local_positions(n: int, page_size: int, rank: int, size: int, device) -> torch.Tensor:
    """Global positions of this rank's ``n`` stored tokens (pages ``j`` with ``j % size == rank``, in order)."""
    r = torch.arange(n, device=device)
    if size == 1:
        return r
    return ((r // page_size) * size + rank) * page_size + r % page_size


def _local_rows(pos: torch.Tensor, page_size: int, rank: int, size: int) -> torch.Tensor:
    """Inverse of :func:`_local_positions`: the row of global position ``pos`` on this rank, -1 if not owned."""
    if size == 1:
        return pos
    page = pos // page_size
    rows = (page // size) * page_size + pos % page_size
    return torch.where(page % size == rank, rows, torch.full_like(pos, -1))


@torch.no_grad()
def _indexer_qkw(indexer: nn.Module, hidden_states, q_resid, cos, sin, rope_fn):
    """HF's indexer projections: queries ``[B, T, Hi, Di]``, keys ``[B, T, Di]`` (``rope_fn`` on the first
    ``qk_rope_head_dim`` dims: interleaved for GLM-5, half-split for DeepSeek-V3.2) and head weights
    ``[B, T, Hi]`` (fp32, times ``Hi ** -0.5``)."""
    b, t, _ = hidden_states.shape
    rope, dim = indexer.qk_rope_head_dim, indexer.head_dim
    q = indexer.wq_b(q_resid).view(b, t, indexer.n_heads, dim)
    q_rot, q_pass = torch.split(q, [rope, dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, dim - rope], dim=-1)
    q_rot, k_rot = rope_fn(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, w * indexer.n_heads**-0.5


@torch.no_grad()
def _select(indexer, iq, w, prompt_keys, prompt_pos, resident, self_keys, q_pos, ctx, page_size):
    """The top-k over the prompt (this rank's pages, then every rank's proposals) and the call's own keys."""
    b, t = iq.shape[:2]
    topk, scale = indexer.index_topk, indexer.softmax_scale
    width = min(topk, resident)  # every rank proposes this many (padded), so the gather has one shape
    if prompt_keys is not None and prompt_keys.shape[0]:
        s, p = indexer_topk(iq, w, prompt_keys[None], prompt_pos, None, scale, topk)
    else:
        s, p = iq.new_empty((b, t, 0), dtype=torch.float32), q_pos.new_empty((b, t, 0))
    if s.shape[-1] < width:
        pad = width - s.shape[-1]
        s = torch.cat([s, s.new_full((b, t, pad), float("-inf"))], -1)
        p = torch.cat([p, p.new_full((b, t, pad), -1)], -1)
    if ctx.cp.size > 1:
        s, p = torch.cat(ctx.cp.all_gather(s), -1), torch.cat(ctx.cp.all_gather(p), -1)
    self_pos = torch.arange(self_keys.shape[1], device=iq.device) + resident
    s2, p2 = indexer_topk(iq, w, self_keys, self_pos, q_pos, scale, topk)
    s, p = topk_merge(s, p, s2, p2, topk)
    valid = s > float("-inf")
    in_prompt = valid & (p < resident)
    prompt_rows = torch.where(
        in_prompt, _local_rows(p, page_size, ctx.cp.rank, ctx.cp.size), torch.full_like(p, -1)
    )
    self_rows = torch.where(valid & ~in_prompt, p - resident, torch.full_like(p, -1))
    if ctx.mode.host_sync_ok:  # a capture chunk's many queries: worth a host sync to drop the empty slots
        return DSASelection(_compact_rows(prompt_rows), _compact_rows(self_rows))
    return DSASelection(prompt_rows, self_rows)


def _compact_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows [B, T, k]`` with each query's chosen rows first, trimmed to the widest query's count (at least 1).

    A capture chunk's top-k falls mostly in the prompt before it: its own keys fill a few slots a query, yet the
    attention over them would gather and score all ``k`` (and the prompt part likewise in the first chunks).
    The chosen set is unchanged (attention over a set does not depend on its order). One host sync: capture
    only, never inside a decode step's CUDA graph or a replay."""
    valid = rows >= 0
    width = max(int(valid.sum(-1).max()), 1) if rows.numel() else rows.shape[-1]
    if width == rows.shape[-1]:
        return rows
    order = valid.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :width]
    return rows.gather(-1, order)


def _prompt_part(
    layer: DSAPages | None,
    sel: DSASelection,
    query: torch.Tensor,
    ctx,
    idx: int,
    resident: int,
    device: torch.device,
    scale: float,
    latent_width: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The attention of ``query`` over the prompt rows ``sel`` chose: ``(out, lse)``, both None without a prompt.
    Every rank takes part, pages or not: the merge over ranks is a collective. In the full gradient the latent rows'
    gradient goes to the pages' buffers (as K/V pages' dK/dV do)."""
    if not resident:
        return None, None
    grads = ctx.grads.kv(idx) if ctx.grads is not None else None
    table, rows, table_fn = _prompt_table(layer, sel, device, ctx.decoding, whole=grads is not None)
    table_grad = None
    if grads is not None:
        sink = grads.sink_joined(layer)
        table_grad = lambda d_latent: sink(d_latent[None], None)  # noqa: E731
    return prompt_selected_attention(
        query,
        rows,
        table,
        table_fn,
        scale,
        latent_width,
        ctx.cp.reduce_partial,
        ctx.cp.reduce_dq,
        table_grad=table_grad,
    )


def dsa_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    position_ids: torch.Tensor,
    prev: DSASelection | None,
    ctx,
    indexer_rope: Callable,
) -> tuple[torch.Tensor, None, DSASelection]:
    """HF's ``GlmMoeDsaAttention.forward`` (and ``DeepseekV32Attention.forward``) on the prompt state: same
    projections, norms, RoPE, scaling and selection; attention in latent space over the selected prompt pages
    and the call's own keys. Returns ``(output, None, selection)``."""
    # the MLA RoPE is interleaved in both families; the module's own modeling file defines it
    apply_rotary_pos_emb_interleave = sys.modules[type(module).__module__].apply_rotary_pos_emb_interleave

    idx = module.layer_idx
    b, t, _ = hidden_states.shape
    nope, rope, r, hv = (
        module.qk_nope_head_dim,
        module.qk_rope_head_dim,
        module.kv_lora_rank,
        module.v_head_dim,
    )
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q = module.q_b_proj(q_resid).view(b, t, -1, module.qk_head_dim).transpose(1, 2)
    heads = q.shape[1]
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states), [r, rope], dim=-1)
    c_kv = module.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, t, rope), cos, sin)
    # kv_b_proj's effective weight [r, H, nope + v] (LoRA and hooks included), then the absorbed query
    w = module.kv_b_proj(torch.eye(r, dtype=c_kv.dtype, device=c_kv.device)).view(r, heads, nope + hv)
    query = torch.cat([torch.einsum("bhtn,rhn->bhtr", q_pass, w[..., :nope]), q_rot], dim=-1)
    latent = torch.cat([c_kv, k_rot[:, 0]], dim=-1)  # [B, T, r + rope]: key [c | k_rot], value c

    indexer = getattr(module, "indexer", None)
    if indexer is not None:
        iq, ik, iw = _indexer_qkw(indexer, hidden_states, q_resid, cos, sin, indexer_rope)
    else:
        iq = iw = None
        ik = latent.new_zeros(b, t, 0)
    layer = ctx.layer_state(
        idx, DSAPages, lambda: ctx.new_pages(latent.unsqueeze(1), ik.unsqueeze(1), DSAPages)
    )
    if layer is not None and layer.v_head_dim != ik.shape[-1]:
        raise LongStrawError(f"layer {idx}: the state's indexer keys do not match the model's indexer types")
    resident = layer.num_tokens if layer is not None else 0

    # the call's own latent and indexer keys (decode: the sequences' buffers, as the engine keeps K/V)
    kb, vb, _ = ctx.response_kv(idx, latent.unsqueeze(1), ik.detach().unsqueeze(1))
    self_kv, self_ik = kb[:, 0], vb[:, 0]

    device = hidden_states.device
    prompt_ik = None
    if indexer is not None and layer is not None:
        prompt_ik = _prompt_indexer_keys(layer, ctx, idx, device)
    if indexer is not None:
        q_pos = position_ids[0] if position_ids.dim() == 2 else position_ids
        prompt_pos = None
        if prompt_ik is not None:
            prompt_pos = _local_positions(
                prompt_ik.shape[0], layer.page_size, ctx.cp.rank, ctx.cp.size, device
            )
        sel = _select(
            indexer, iq, iw, prompt_ik, prompt_pos, resident, self_ik, q_pos, ctx, ctx.state.page_size
        )
    else:
        if not isinstance(prev, DSASelection):
            raise LongStrawError(
                f"layer {idx} reuses the previous layer's top-k ('shared' indexer) but got {type(prev).__name__}: "
                "the first layer must be a 'full' indexer layer"
            )
        sel = prev

    scale = module.scaling
    out_p, lse_p = _prompt_part(layer, sel, query, ctx, idx, resident, device, scale, r)
    out_s, lse_s = selected_attention(query, self_kv, sel.self_rows, scale, r)
    out, _ = merge_partials(out_p, lse_p, out_s, lse_s)
    ctx.keep_kv(idx, layer, latent.unsqueeze(1), ik.unsqueeze(1))
    # back from latent space through kv_b_proj's V half: [B, H, T, r] -> [B, T, H * v]
    attn = torch.einsum("bhtr,rhv->bthv", out.to(query.dtype), w[..., nope:]).reshape(b, t, heads * hv)
    return module.o_proj(attn), None, sel


def install_dsa_forward(
    cls: type[nn.Module], ctx_kwarg: str, indexer_rope: Callable, shares_topk: bool
) -> None:
    """Wrap ``cls.forward`` (idempotent): with ``ctx_kwarg`` run :func:`dsa_forward`, else the stock code.

    ``shares_topk``: the stock forward takes ``prev_topk_indices`` and returns the selection as a third output
    (GLM-5's IndexShare); otherwise (DeepSeek-V3.2) it returns two outputs and every layer selects its own.
    """
    stock = cls.forward
    if getattr(stock, "_longstraw_dsa", False):
        return

    @functools.wraps(stock)
    def forward(
        self,
        hidden_states,
        position_embeddings=None,
        attention_mask=None,
        past_key_values=None,
        position_ids=None,
        **kwargs,
    ):
        ctx = kwargs.pop(ctx_kwarg, None)
        if ctx is None:
            return stock(
                self,
                hidden_states,
                position_embeddings,
                attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
                **kwargs,
            )
        if past_key_values is not None:
            raise LongStrawError("a LongStraw call cannot also use an HF cache (past_key_values)")
        if attention_mask is not None:
            raise LongStrawError("a LongStraw call takes no attention_mask: rows are right-padded instead")
        prev = kwargs.get("prev_topk_indices")
        out = dsa_forward(self, hidden_states, position_embeddings, position_ids, prev, ctx, indexer_rope)
        return out if shares_topk else out[:2]

    forward._longstraw_dsa = True
    forward._longstraw_stock = stock
    cls.forward = forward


def _has_mla_dsa(config) -> bool:
    """Whether ``config``'s attention is MLA with a DSA indexer (GLM-5, DeepSeek-V3.2)."""
    return bool(getattr(config, "index_topk", None) and getattr(config, "kv_lora_rank", None))


def _capture_bytes(config, chunk: int) -> int:
    """A capture chunk's transient through an MLA + DSA layer, at its peak: the merge of the attention over the
    selected prompt rows with the chunk's own (``merge_partials``), where five fp32 ``[H, chunk, kv_lora]`` tensors
    are alive (both parts, both weighted terms, the merged output), beside the absorbed query ``[H, chunk, kv_lora +
    rope]``, the q / q_lora / indexer-query projections, three hidden-size activations, this and the previous layer's
    int64 selections, and the absorbed ``kv_b_proj`` weights. Itemised on the CPU with every tensor's lifetime
    tracked, and within 0.6% of the 13.52 GiB the GLM-5 slice's train() step added over its weights and state on an
    H100 at a 16K chunk (``tests/test_planner.py``)."""
    heads, lat = config.num_attention_heads, config.kv_lora_rank
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    per_token = (
        20 * heads * lat
        + 2 * heads * (lat + nope + 3 * rope)
        + 2 * (config.q_lora_rank + config.index_n_heads * config.index_head_dim)
        + 6 * config.hidden_size
        + 32 * config.index_topk
        + 4096
    )
    return chunk * per_token + 2 * lat * heads * (nope + config.v_head_dim)


def _backward_bytes(config, segment: int, resident: int, b: int) -> int:
    """What an MLA + DSA layer holds at the peak of its backward over a ``segment`` of prompt tokens after
    ``resident`` ones (the full gradient's prompt backward): per token the absorbed query ``[H, kv_lora + rope]`` and
    the projected ``q``, both parts' selections (int64 top-k each), both parts' fp32 ``[H, kv_lora]`` outputs kept for
    the merge's backward and the gradients of the merged output and of a part, and the part's fp32 dQ; beside them
    one query tile of the selected-keys backward (``selected_attention_dq``: its gathered rows, five fp32 score-sized
    tensors and the rows' fp32 gradient with its value-half temporary) and the fp32 gradient of the whole latent
    table. Itemised from that code and measured on the CPU at the real widths (4.85 / 5.20 / 5.89 GiB a segment of
    512 / 1,024 / 2,048 tokens, 0.68 MiB a token; this term gives 4.84 / 5.24 / 6.04, 0.77 MiB a token and 4.6 GiB
    beside, ``tests/test_planner.py``)."""
    heads, lat, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    width, topk = lat + rope, config.index_topk
    per_token = (
        4 * heads * lat * 4  # both parts' outputs (the merge saves them) and two gradients of that size
        + heads * width * (4 + b)  # the part's dQ (fp32) and the absorbed query
        + heads * config.qk_head_dim * b  # q, saved by its split and the absorbing einsum
        + 2 * 8 * topk  # the prompt's and the segment's own selected rows
    )
    rows, keys = ATTENTION_QUERY_ROWS, min(topk, resident + segment)
    tile = rows * keys * (width * (b + 4 + 4) + lat * 4) + 5 * heads * rows * keys * 4
    return segment * per_token + tile + resident * width * 4


class DSAPatch(FamilyPatch):
    """Families of MLA + DeepSeek Sparse Attention layers: every layer keeps a :class:`DSAPages`; attention is
    dispatched by :func:`dsa_forward`, installed on the attention class by :meth:`apply`."""

    def layer_state_type(self, config, layer_idx: int) -> type[LayerState]:
        return DSAPages

    def no_attention_masks(self, model: nn.Module) -> dict:
        return {MASK_KEY: None}  # a prepared mapping: HF builds no causal mask (the engine masks by position)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [layer.self_attn for layer in self.decoder(model).layers]

    def validate(self, model: nn.Module) -> None:
        config = self.text_config(model)
        types = _indexer_types(config)
        other = sorted(set(types) - {FULL_INDEXER, SHARED_INDEXER})
        if other:
            raise self.unsupported(
                f"indexer types {other} (only {FULL_INDEXER!r} and {SHARED_INDEXER!r} are)"
            )
        if types and types[0] != FULL_INDEXER:
            raise self.unsupported(
                f"indexer_types[0]={types[0]!r} (the first layer must run its indexer: 'full')"
            )
        if not config.index_topk or config.index_topk < 1:
            raise self.unsupported(f"index_topk={config.index_topk!r} (must be >= 1)")
        self.validate_common(config)
        for module in self.attention_modules(model):
            if not all(hasattr(module, a) for a in ("kv_b_proj", "q_a_proj", "kv_a_proj_with_mqa")):
                raise self.unsupported(f"an attention layer of type {type(module).__name__}")

    def planned_capture_bytes(self, config, chunk: int, dtype_bytes: int) -> int:
        """The larger of the shared formula and an MLA + DSA layer's peak (:func:`_capture_bytes`)."""
        shared = super().planned_capture_bytes(config, chunk, dtype_bytes)
        return max(shared, _capture_bytes(config, chunk)) if _has_mla_dsa(config) else shared

    def planned_segment_layer_bytes(
        self, config, kind: str, segment: int, resident: int, dtype_bytes: int
    ) -> int:
        """The larger of the layer's graph over the segment and an MLA + DSA layer's backward
        (:func:`_backward_bytes`) or its forward's merge (:func:`_capture_bytes`)."""
        graph = super().planned_segment_layer_bytes(config, kind, segment, resident, dtype_bytes)
        if not _has_mla_dsa(config):
            return graph
        return max(
            graph, _backward_bytes(config, segment, resident, dtype_bytes), _capture_bytes(config, segment)
        )

    #: whether a ``"shared"`` layer reuses the previous full layer's top-k (HF passes it as ``prev_topk_indices``)
    shares_topk = True

    def indexer_rope(self, model: nn.Module) -> Callable:
        """The RoPE of the indexer (GLM-5: interleaved pairs, like the MLA part)."""
        return sys.modules[type(self.attention_modules(model)[0]).__module__].apply_rotary_pos_emb_interleave

    def apply(self, model: nn.Module) -> None:
        rope = self.indexer_rope(model)
        for cls in {type(m) for m in self.attention_modules(model)}:
            install_dsa_forward(cls, CTX_KWARG, rope, self.shares_topk)


class GlmMoeDsaPatch(DSAPatch):
    """``glm_moe_dsa`` (GLM-5): ``"full"`` and ``"shared"`` (IndexShare) indexer layers."""

    model_types = ("glm_moe_dsa",)


class DeepseekV32Patch(DSAPatch):
    """``deepseek_v32`` (DeepSeek-V3.2): the same MLA + DSA layers, every layer with its own indexer, whose RoPE
    is half-split (``rotate_half``) instead of interleaved; the attention returns no selection."""

    model_types = ("deepseek_v32",)
    shares_topk = False

    def indexer_rope(self, model: nn.Module) -> Callable:
        return sys.modules[type(self.attention_modules(model)[0]).__module__].apply_rotary_pos_emb
