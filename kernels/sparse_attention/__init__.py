"""DeepSeek Sparse Attention (DSA): the indexer's scores (``indexer``, its reference in ``naive``) and top-k choice,
and attention over the chosen keys (``dsa``, with the fused selected-keys kernel in ``selected_keys``)."""

from .dsa import indexer_topk, prompt_selected_attention, selected_attention, topk_merge
from .indexer import index_scores
from .naive import naive_index_scores

__all__ = [
    "index_scores",
    "indexer_topk",
    "naive_index_scores",
    "prompt_selected_attention",
    "selected_attention",
    "topk_merge",
]
