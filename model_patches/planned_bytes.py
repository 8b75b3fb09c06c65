"""The memory planner's per-token formulas for the layers most families share: GQA attention, a dense or routed MLP,
and a capture chunk's activations.

:class:`~.base.FamilyPatch` plans with these by default; a family whose layers hold other tensors (Gated DeltaNet,
Mamba-2, MLA + DSA) overrides its ``planned_*`` methods in its own module, beside its ``LayerState.planned_bytes``.
``b`` is the bytes of one element of the model's dtype.
"""

from __future__ import annotations


def attention_head_dim(config) -> int:
    """``config.head_dim``, else ``hidden_size / num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_graph_bytes(config, b: int, gated: bool = False) -> int:
    """Per token, what autograd keeps for one GQA attention: the norm's input and output, the projections (with the
    q / k norm and RoPE copies), the output projection's input and the fp32 merged output kept for backward;
    ``gated``: also the output gate (Qwen3.5, Qwen3-Next)."""
    h = config.hidden_size
    head_dim = attention_head_dim(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    gate = q if gated else 0
    return (2 * h + 3 * (q + 2 * kv) + 2 * q + 2 * gate) * b + q * 4


def mlp_graph_bytes(config, b: int) -> int:
    """Per token, what autograd keeps for one MLP: the norm's input and output, gate, up and ``act(gate) * up``, at
    the routed experts' width times ``num_experts_per_tok`` in an MoE model (``num_experts`` in Qwen MoE,
    ``n_routed_experts`` in GLM)."""
    h = config.hidden_size
    routed = getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)
    inter = getattr(config, "moe_intermediate_size", None) if routed else None
    inter = (inter or config.intermediate_size) * max(1, getattr(config, "num_experts_per_tok", 1) or 1)
    return (2 * h + 3 * inter) * b


def capture_chunk_bytes(config, chunk: int, b: int) -> int:
    """A capture chunk's transient activations through one layer: the hidden size twice and the MLP's three
    intermediates in the model's dtype, and three fp32 query-sized attention tensors, per token. MoE-only configs
    (``qwen3_5_moe``) have no dense ``intermediate_size``: the routed experts' width, as in the graph."""
    inter = (
        getattr(config, "intermediate_size", None)
        or config.moe_intermediate_size * config.num_experts_per_tok
    )
    heads = config.num_attention_heads * attention_head_dim(config)
    return chunk * ((2 * config.hidden_size + 3 * inter) * b + 3 * heads * 4)
