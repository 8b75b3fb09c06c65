"""Softmax attention that returns its log-sum-exp, the exact merge of partial attentions, and the prompt-page dQ
kernel (``prompt_dq``); ``naive`` holds the plain torch references."""

from .prompt_response import (
    attention_grads,
    attention_lse,
    fold_gqa,
    masked_decode_attention_lse,
    merge_partials,
    merge_sink,
    pages_attention,
    pages_attention_dq,
    prompt_response_attention,
    repeat_kv,
    unfold_gqa,
    window_attention,
)

__all__ = [
    "attention_grads",
    "attention_lse",
    "fold_gqa",
    "masked_decode_attention_lse",
    "merge_partials",
    "merge_sink",
    "pages_attention",
    "pages_attention_dq",
    "prompt_response_attention",
    "repeat_kv",
    "unfold_gqa",
    "window_attention",
]
