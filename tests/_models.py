"""Tiny random-init models of every supported family (fp32, CPU) for tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

GQA_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, head_dim=16),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **{**COMMON, "intermediate_size": 96},
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    ),
}


def build(family: str, seed: int = 0, attn_implementation: str = "eager"):
    torch.manual_seed(seed)
    config = GQA_CONFIGS[family]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.float().eval()
