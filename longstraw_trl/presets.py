"""Built-in model dimensions (no weights): real layer sizes for benchmarks and the memory planner.

Benchmarks build these with fewer layers (``num_hidden_layers=...``) and random weights, and say so.
"""

from __future__ import annotations

from transformers import GlmMoeDsaConfig, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config

PRESETS = {
    # Qwen3-8B: 36 layers of full GQA attention.
    "qwen3-8b": dict(
        cls=Qwen3Config,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
    # Qwen3.6-27B (qwen3_5 text): 64 layers, every 4th full (gated) attention, the rest Gated DeltaNet.
    "qwen3.6-27b": dict(
        cls=Qwen3_5TextConfig,
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        tie_word_embeddings=False,
    ),
}
# GLM-5 (glm_moe_dsa): MLA (q_lora 2048, kv_lora 512, rope 64), DSA indexer 32 x 128 with top-2048, 256
# experts top-8 + 1 shared, 3 dense then 75 MoE layers. transformers' defaults for this config are these
# dimensions, and its indexer_types: GLM-5's released config sets no IndexShare keys (index_topk_freq /
# index_topk_pattern), so every layer runs its own indexer ("full"). A slice keeps that rule; a benchmark that
# wants "shared" layers passes indexer_types itself (bench/glm_slice.py).
PRESETS["glm-5"] = dict(cls=GlmMoeDsaConfig)


def preset_config(name: str, num_hidden_layers: int | None = None, **overrides) -> PretrainedConfig:
    """A config with a preset's real dimensions; ``num_hidden_layers`` makes a slice.

    For hybrid presets the slice keeps the full model's pattern (3 GDN layers then 1 full attention).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    spec = dict(PRESETS[name])
    cls = spec.pop("cls")
    layers = num_hidden_layers or spec.get("num_hidden_layers") or cls().num_hidden_layers
    spec["num_hidden_layers"] = layers
    if cls is Qwen3_5TextConfig:
        spec["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ]
    spec.update(overrides)
    return cls(**spec)
