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
    "glm4_moe": lambda: _glm4_moe(),
}


def _glm4_moe():
    """GLM-4.5 / 4.6 / 4.7 class: one dense layer, then two MoE layers with a shared expert and a grouped
    sigmoid router (2 groups of 4 experts, top-1 group, top-2 experts, scaled); partial rotary, qk-norm
    and attention bias on."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **{**COMMON, "num_hidden_layers": 3},
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def build(family: str, seed: int = 0, attn_implementation: str = "eager"):
    torch.manual_seed(seed)
    config = GQA_CONFIGS[family]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    _spread_router_bias(model)
    return model.float().eval()


@torch.no_grad()
def sharp_routers(model, scale: float = 30.0):
    """Sharpen the softmax routers (``mlp.gate.weight``, GPT-OSS's ``mlp.router.weight``): at HF's init every token routes almost uniformly and the
    load-balancing gradients are tiny. Returns the model."""
    for name, param in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # GPT-OSS: mlp.router
            param.mul_(scale)
    return model


@torch.no_grad()
def _spread_router_bias(model):
    """HF initialises GLM's ``e_score_correction_bias`` (the load-balancing bias added to the scores only for
    choosing experts) to zeros; draw it so the choice and the weights differ, as in trained checkpoints."""
    gen = torch.Generator().manual_seed(4321)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


# ----------------------------------------------------------------------------------------------------
# Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6, Qwen3.5-MoE, Qwen3-Next): two GDN layers around one
# gated full-attention layer, grouped value heads (2 key heads serve 4 value heads), partial rotary.
# ----------------------------------------------------------------------------------------------------
HYBRID_COMMON = dict(
    COMMON,
    num_hidden_layers=3,
    head_dim=32,  # partial_rotary_factor 0.25 -> 8 rotary dims, 4 frequencies
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
HYBRID_MOE = dict(
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
)
# mrope as in the released checkpoints, scaled down: sections sum to the 4 rotary frequencies
MROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1])
MROPE_INTERLEAVED = dict(MROPE, mrope_interleaved=True)
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


def _qwen3_5_text():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**HYBRID_COMMON, rope_parameters=MROPE_INTERLEAVED)


def _qwen3_5_vl():
    from transformers import Qwen3_5Config

    text = dict(HYBRID_COMMON, rope_parameters=MROPE)
    return Qwen3_5Config(text_config=text, vision_config=TINY_VISION, tie_word_embeddings=False)


def _qwen3_5_moe_text():
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**HYBRID_COMMON, **HYBRID_MOE, rope_parameters=MROPE_INTERLEAVED)


def _qwen3_5_moe_vl():
    from transformers import Qwen3_5MoeConfig

    text = dict(HYBRID_COMMON, **HYBRID_MOE, rope_parameters=MROPE)
    return Qwen3_5MoeConfig(text_config=text, vision_config=TINY_VISION, tie_word_embeddings=False)


def _qwen3_next():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**HYBRID_COMMON, **HYBRID_MOE, decoder_sparse_step=1, norm_topk_prob=True)


HYBRID_CONFIGS = {
    "qwen3_5": _qwen3_5_text,
    "qwen3_5_vl": _qwen3_5_vl,  # Qwen3_5ForConditionalGeneration, text-only inputs
    "qwen3_5_moe": _qwen3_5_moe_text,
    "qwen3_5_moe_vl": _qwen3_5_moe_vl,
    "qwen3_next": _qwen3_next,
}


def _conditional_generation(family: str):
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    return {
        "qwen3_5_vl": Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe_vl": Qwen3_5MoeForConditionalGeneration,
    }.get(family)


def build_hybrid(family: str, seed: int = 0, attn_implementation: str = "eager", **overrides):
    torch.manual_seed(seed)
    config = HYBRID_CONFIGS[family]()
    for name, value in overrides.items():  # e.g. the toy tokenizer's vocabulary and special ids
        setattr(config, name, value)
    cls = _conditional_generation(family)
    if cls is not None:
        model = cls._from_config(config, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    _moderate_gdn_decay(model)
    return model.float().eval()


@torch.no_grad()
def _moderate_gdn_decay(model):
    """HF initialises the GDN decay rate ``A`` uniformly in (0.01, 16): most heads then forget within a token
    or two and the gradients of ``A_log`` / ``dt_bias`` are ~1e-5 of the others, all cancellation, so their
    fp32 relative error means nothing. Draw ``A`` in (0.1, 2) instead: every head carries state across
    chunks (which is what the tests are about) and every gradient is well conditioned."""
    gen = torch.Generator().manual_seed(1234)
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.A_log"):
            param.copy_(torch.empty(param.shape).uniform_(0.1, 2.0, generator=gen).log())


# ----------------------------------------------------------------------------------------------------
# Sliding-window families: a window of 8 (prompts in the tests are longer, responses too for some),
# sliding and full layers mixed where the family mixes them, soft-caps small enough to bite on
# random-init scores and logits, and sinks drawn large enough to matter.
# ----------------------------------------------------------------------------------------------------
WINDOW = 8
ATTN = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    sliding_window=WINDOW,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**ATTN, num_hidden_layers=2, rms_norm_eps=1e-6)


def _ministral():
    from transformers import MinistralConfig

    return MinistralConfig(**ATTN, num_hidden_layers=3, rms_norm_eps=1e-6, layer_types=MIXED)


def _cohere2():
    from transformers import Cohere2Config

    return Cohere2Config(**ATTN, num_hidden_layers=3, layer_types=MIXED, logit_scale=4.0)


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(
        **ATTN,
        num_hidden_layers=3,
        layer_types=MIXED,
        query_pre_attn_scalar=9,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=0.5,
    )


def _gemma3_text():
    from transformers import Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    }
    return Gemma3TextConfig(
        **ATTN,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters=rope,
        query_pre_attn_scalar=9,
        final_logit_softcapping=0.5,
    )


def _gpt_oss():
    from transformers import GptOssConfig

    return GptOssConfig(
        **{**ATTN, "intermediate_size": 32},
        num_hidden_layers=3,
        layer_types=MIXED,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def _qwen2_sliding():
    # sliding layers from max_window_layers on: [full, sliding, sliding]
    return Qwen2Config(**ATTN, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1)


def _qwen3_sliding():
    return Qwen3Config(**ATTN, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1)


def _qwen3_moe_sliding():
    # no layer_types: one window for every layer
    return Qwen3MoeConfig(
        **ATTN,
        num_hidden_layers=2,
        use_sliding_window=True,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


WINDOW_CONFIGS = {
    "mistral": _mistral,
    "ministral": _ministral,
    "cohere2": _cohere2,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gpt_oss": _gpt_oss,
    "qwen2_sliding": _qwen2_sliding,
    "qwen3_sliding": _qwen3_sliding,
    "qwen3_moe_sliding": _qwen3_moe_sliding,
}


# Random-init scores are ~0.01: q/k weights scaled up so that attention is far from uniform (the band
# mask matters) and the scores reach the attention soft-cap.
QK_GAIN = 6.0


def build_window(family: str, seed: int = 0, attn_implementation: str = "eager", **overrides):
    """A tiny model of a sliding-window family; ``overrides`` set config fields (e.g. ``vocab_size``)."""
    torch.manual_seed(seed)
    config = WINDOW_CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 99)
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):  # HF draws them near 0; spread them so the sink term matters
                param.copy_(torch.empty(param.shape).uniform_(-1.0, 2.0, generator=gen))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(QK_GAIN)
    return model.float().eval()


# ----------------------------------------------------------------------------------------------------
# GLM-5 (glm_moe_dsa): MLA + DSA indexer, two dense then two MoE layers, indexer types full/shared/full/shared
# ----------------------------------------------------------------------------------------------------
# Random-init indexer scores are ~1e-3 and half the heads are cut by the ReLU, so many keys score exactly 0
# (ties in the top-k). The gains spread the scores so the top-k boundary is tie-free (the tests check it).
INDEXER_Q_GAIN, INDEXER_W_GAIN = 8.0, 20.0


def glm_dsa_config(index_topk: int = 2048, family: str = "glm_moe_dsa", **overrides):
    """GLM-5 (``glm_moe_dsa``) or, with the same sizes, DeepSeek-V3.2 (``deepseek_v32``: every layer indexes)."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    spec = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=12,
        index_topk=index_topk,
        index_head_dim=16,
        index_n_heads=16,
        first_k_dense_replace=2,
        indexer_types=["full", "shared", "full", "shared"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    spec.update(overrides)
    if family == "deepseek_v32":
        spec.pop("indexer_types")
        return DeepseekV32Config(**spec)
    return GlmMoeDsaConfig(**spec)


def build_glm_dsa(
    index_topk: int = 2048,
    seed: int = 0,
    attn_implementation: str = "eager",
    family: str = "glm_moe_dsa",
    **overrides,
):
    """A tiny GLM-5 (``glm_moe_dsa``) of 4 layers (2 dense, 2 MoE; indexer full, shared, full, shared), or
    DeepSeek-V3.2 (``family="deepseek_v32"``) of the same sizes with an indexer on every layer."""
    torch.manual_seed(seed)
    config = glm_dsa_config(index_topk, family, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    _spread_router_bias(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("indexer.wq_b.weight"):
                param.mul_(INDEXER_Q_GAIN)
            if name.endswith("indexer.weights_proj.weight"):
                param.mul_(INDEXER_W_GAIN)
    return model.float().eval()


# ----------------------------------------------------------------------------------------------------
# Nemotron-H (nemotron_h): Mamba-2 blocks between attention (no positional encoding), MLP and MoE blocks
# ----------------------------------------------------------------------------------------------------
NEMOTRON_H_PATTERN = "M*-ME"  # Mamba-2, attention, MLP, Mamba-2, MoE


def nemotron_h_config(**overrides):
    """A tiny Nemotron-H: 5 blocks ``M * - M E``; Mamba-2 with 4 heads of 8 in 2 groups, a 16-wide SSM state, a
    4-tap conv and SSD chunks of 16 tokens (a capture chunk spans several); GQA attention 4 / 2 heads of 16; an MoE
    of 4 sigmoid-routed experts (top 2) with a shared expert."""
    from transformers import NemotronHConfig

    spec = dict(
        vocab_size=97,
        hidden_size=64,
        hybrid_override_pattern=NEMOTRON_H_PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        n_group=1,
        topk_group=1,
        max_position_embeddings=1024,
        layer_norm_epsilon=1e-6,
        tie_word_embeddings=False,
    )
    spec.update(overrides)
    return NemotronHConfig(**spec)


def build_nemotron_h(seed: int = 0, attn_implementation: str = "eager", **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        nemotron_h_config(**overrides), attn_implementation=attn_implementation
    )
    _spread_router_bias(model)
    _lively_mamba2(model)
    return model.float().eval()


MAMBA2_IN_GAIN, MAMBA2_CONV_GAIN = 4.0, 25.0


@torch.no_grad()
def _lively_mamba2(model):
    """HF's init makes the Mamba-2 blocks nearly inert: ``dt`` in (0.001, 0.1) with ``D = 1`` leaves the SSM's share
    of the output ~1e-3 of the skip term, so a test could drop the whole state and still pass at 1e-4. Draw ``dt`` in
    (0.05, 0.5) (``dt_bias``), ``A`` in (0.02, 0.5), ``D`` in (0, 0.5) and scale ``in_proj`` and the conv
    weight (std 0.02: B, C and x would be ~1e-2, their product in the output ~1e-5) up: every head then carries
    state over tens of tokens and the state decides the outputs (``test_the_prompt_state_decides_the_logprobs``)."""
    gen = torch.Generator().manual_seed(2024)
    for name, param in model.named_parameters():
        if name.endswith("mixer.dt_bias"):
            dt = torch.empty(param.shape).uniform_(0.05, 0.5, generator=gen)
            param.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        elif name.endswith("mixer.A_log"):
            param.copy_(torch.empty(param.shape).uniform_(0.02, 0.5, generator=gen).log())
        elif name.endswith("mixer.D"):
            param.copy_(torch.empty(param.shape).uniform_(0.0, 0.5, generator=gen))
        elif name.endswith("mixer.in_proj.weight"):
            param.mul_(MAMBA2_IN_GAIN)
        elif name.endswith("mixer.conv1d.weight"):
            param.mul_(MAMBA2_CONV_GAIN)


# ----------------------------------------------------------------------------------------------------
# The other MoE families of the expert-parallel tests (tests/test_trainer_ep.py), with the given overrides (e.g. the
# trainer tests' vocabulary and special tokens)
# ----------------------------------------------------------------------------------------------------
def build_moe(family: str, seed: int = 0, **overrides):
    """A tiny ``glm4_moe`` (1 dense + 2 MoE layers, 8 routed experts + 1 shared, grouped sigmoid router),
    ``qwen3_5_moe`` (GDN / full / GDN, 4 experts top-2 + a shared expert, routers sharpened) or ``gpt_oss`` (sliding /
    full / sliding, 4 experts top-2, sinks, biases drawn away from zero) with ``overrides`` set on its config before
    the weights are drawn."""
    if family == "gpt_oss":
        model = build_window(family, seed, **overrides)
        _spread_zero_biases(model)
        return model
    torch.manual_seed(seed)
    config = (GQA_CONFIGS if family == "glm4_moe" else HYBRID_CONFIGS)[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family == "glm4_moe":
        _spread_router_bias(model)
    else:
        _moderate_gdn_decay(model)
        sharp_routers(model)
    return model.float().eval()


@torch.no_grad()
def _spread_zero_biases(model):
    """HF initialises GPT-OSS's biases (attention, router, experts) to zeros, so after one step such a bias holds only
    the update, Adam's ``lr * g / (|g| + eps)``, whose elements with ``|g|`` near ``eps`` turn the gradient's fp32
    rounding into a relative error of the updated bias far above the gradient's (watched: 2e-5 to 4e-5 from gradients
    equal within 1.2e-6). Draw them away from zero, as trained checkpoints have them."""
    gen = torch.Generator().manual_seed(2468)
    for name, param in model.named_parameters():
        if name.endswith("bias") and not param.any():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
