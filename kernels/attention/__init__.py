"""Softmax attention that returns its log-sum-exp, and the exact merge of partial attentions.

``sdpa``: one key part by PyTorch's fused ops (flash, cuDNN, CPU flash), forward and backward; ``merge``: the LSE
merge of parts and the grouped-query layouts; ``prompt_response``: response queries over read-only prompt pages plus
their own causal keys; ``window``: sliding-window layers; ``prompt_dq``: the Triton dQ kernel over prompt pages
(the function is not re-exported, so that ``attention.prompt_dq`` names the module); ``naive``: the plain torch
references.
"""

from .merge import fold_gqa, merge_partials, merge_sink, repeat_kv, unfold_gqa
from .naive import naive_attention_grads, naive_attention_lse, naive_prompt_dq
from .prompt_dq import prompt_dq_available
from .prompt_response import (
    masked_decode_attention_lse,
    pages_attention,
    pages_attention_dq,
    prompt_response_attention,
)
from .sdpa import attention_grads, attention_lse
from .window import window_attention

__all__ = [
    "attention_grads",
    "attention_lse",
    "fold_gqa",
    "masked_decode_attention_lse",
    "merge_partials",
    "merge_sink",
    "naive_attention_grads",
    "naive_attention_lse",
    "naive_prompt_dq",
    "pages_attention",
    "pages_attention_dq",
    "prompt_dq_available",
    "prompt_response_attention",
    "repeat_kv",
    "unfold_gqa",
    "window_attention",
]
