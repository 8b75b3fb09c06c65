"""What the GRPO loss is, independently of the data: TRL's loss types and the loss-related fields of a `GRPOConfig`
resolved as `GRPOTrainer.__init__` resolves them (:class:`GRPOLossSpec`); `longstraw_trl.loss` computes the terms."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trl import GRPOConfig

__all__ = ["CLIPPED_LOSS_TYPES", "LOSS_TYPES", "TOKEN_NORMALIZED_LOSS_TYPES", "GRPOLossSpec"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""Every `loss_type` of TRL 1.16's `GRPOTrainer._compute_loss`."""

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""Loss types using PPO-style clipped ratios (and logging `clip_ratio/*`)."""

TOKEN_NORMALIZED_LOSS_TYPES = ("cispo", "dapo", "vespo")
"""Loss types normalized by the global token count `num_items_in_batch` (no separate division by `ga`)."""

_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
_GRPO_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING
}


@dataclass(frozen=True)
class GRPOLossSpec:
    """
    Everything about the GRPO loss that does not depend on the data: the loss-related fields of a `GRPOConfig`,
    resolved the way `GRPOTrainer.__init__` resolves them. Build it with [`GRPOLossSpec.from_args`].

    Parameters:
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            One of [`LOSS_TYPES`]; TRL's `GRPOConfig.loss_type`.
        importance_sampling_level (`str`, *optional*, defaults to `"token"`):
            `"token"` (one ratio per token) or `"sequence"` (GSPO: exp of the masked mean log-ratio per sequence).
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient. When non-zero, reference log-probs must be passed for every response.
        epsilon_low (`float`, *optional*, defaults to `0.2`):
            Lower clipping range, TRL's `args.epsilon` (`trainer.epsilon_low`).
        epsilon_high (`float`, *optional*, defaults to `0.2`):
            Upper clipping range, `args.epsilon_high` or, when that is `None`, `args.epsilon`. For `cispo` it is
            the cap ε_max of the (detached) importance weights.
        delta (`float` or `None`, *optional*, defaults to `None`):
            Upper bound of the unclipped ratio in two-sided clipping (INTELLECT-2). `None` disables it.
        use_bias_correction_kl (`bool`, *optional*, defaults to `True`):
            Multiply the per-token KL by the (differentiable) importance ratio.
        sapo_temperature_pos (`float`, *optional*, defaults to `1.0`):
            SAPO gate temperature for tokens with positive advantage.
        sapo_temperature_neg (`float`, *optional*, defaults to `1.05`):
            SAPO gate temperature for tokens with non-positive advantage.
        vespo_k_pos (`float`, *optional*, defaults to `2.0`):
            VESPO gamma-weight exponent for non-negative advantages.
        vespo_lambda_pos (`float`, *optional*, defaults to `3.0`):
            VESPO gamma-weight decay for non-negative advantages.
        vespo_k_neg (`float`, *optional*, defaults to `3.0`):
            VESPO gamma-weight exponent for negative advantages.
        vespo_lambda_neg (`float`, *optional*, defaults to `2.0`):
            VESPO gamma-weight decay for negative advantages.
        off_policy_mask_threshold (`float` or `None`, *optional*, defaults to `None`):
            DeepSeek-V3.2 off-policy sequence masking threshold on the mean per-token KL(sampler || policy) of a
            sequence; `None` disables it.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            Whether TRL applies its vLLM importance-sampling correction, i.e. `args.use_vllm and
            args.vllm_importance_sampling_correction`. When `True`, every response needs its
            `importance_sampling_ratio` row.
        max_completion_length (`int` or `None`, *optional*, defaults to `None`):
            `args.max_completion_length`; the constant denominator of `dr_grpo` (required for it).
        gradient_accumulation_steps (`int`, *optional*, defaults to `1`):
            `args.gradient_accumulation_steps`; the default for `batch_loss_context(gradient_accumulation_steps=)`,
            which should be given the Trainer's `current_gradient_accumulation_steps` instead.
        steps_per_generation (`int`, *optional*, defaults to `1`):
            `args.steps_per_generation` (resolved by `GRPOConfig.__post_init__`, defaulting to
            `gradient_accumulation_steps`); divides the `dapo`/`cispo`/`vespo` normalizer in train mode.
        entropy_coef (`float`, *optional*, defaults to `0.0`):
            Entropy bonus coefficient (static), or the initial one under `use_adaptive_entropy` (the coefficient a
            micro-batch applies is then given to `batch_loss_context(entropy_coef=)`). While the bonus is enabled,
            every response needs its per-token `entropies_i`.
        top_entropy_quantile (`float`, *optional*, defaults to `1.0`):
            Below `1.0`, only the tokens whose entropy is at or above this quantile (over the micro-batch, all
            processes) enter the policy loss and the entropy bonus: pass the mask to
            `batch_loss_context(entropy_mask=)` (see [`high_entropy_mask`]).
        use_adaptive_entropy (`bool`, *optional*, defaults to `False`):
            TRL's adaptive entropy control (Skywork-OR1): the coefficient is updated once per optimizer step by the
            caller (see [`adaptive_entropy_coef`]); the bonus is enabled even while the coefficient is zero.
        router_aux_loss_coef (`float`, *optional*, defaults to `0.0`):
            Effective MoE load-balancing coefficient (TRL's `trainer.router_aux_loss_coef`). `response_loss` does not
            include that term; the trainer adds it per response (`longstraw_trl.router_aux`).
    """

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    vllm_importance_sampling_correction: bool = False
    max_completion_length: int | None = None
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    use_adaptive_entropy: bool = False
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type!r}. Supported: {', '.join(LOSS_TYPES)}.")
        if self.importance_sampling_level not in _IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"Unknown importance sampling level: {self.importance_sampling_level!r}. Possible values are "
                "'token' and 'sequence'."
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' normalizes by `max_completion_length`, which is None.")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}.")

    @property
    def entropy_bonus_enabled(self) -> bool:
        """TRL's `_entropy_bonus_enabled`: a static coefficient, or adaptive control (on even at a zero coefficient)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @classmethod
    def from_args(cls, args: Any, *, model: Any = None) -> GRPOLossSpec:
        """Resolve the loss fields of a `GRPOConfig` (or any object with the same attribute names) like
        `GRPOTrainer.__init__` does. Attributes missing on `args` take `GRPOConfig`'s defaults.

        Args:
            args (`GRPOConfig`-like):
                The training arguments. `steps_per_generation` falls back to `gradient_accumulation_steps` when it
                is `None` (as `GRPOConfig.__post_init__` resolves it).
            model (`PreTrainedModel`, *optional*):
                The policy. When given, the effective MoE auxiliary-loss coefficient is resolved like TRL does
                (`args.router_aux_loss_coef`, or the model config's own when that is `None`, counted only if the
                config declares `output_router_logits`).
        """

        def get(name):
            return getattr(args, name, _GRPO_DEFAULTS.get(name))

        epsilon = get("epsilon")
        epsilon_high = get("epsilon_high")
        gradient_accumulation_steps = get("gradient_accumulation_steps") or 1
        steps_per_generation = get("steps_per_generation") or gradient_accumulation_steps

        coef = get("router_aux_loss_coef")
        if model is not None:
            text_config = model.config.get_text_config()
            effective = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
            router_aux_loss_coef = effective if hasattr(text_config, "output_router_logits") else 0.0
        else:
            router_aux_loss_coef = coef or 0.0

        return cls(
            loss_type=get("loss_type"),
            importance_sampling_level=get("importance_sampling_level"),
            beta=get("beta"),
            epsilon_low=epsilon,
            epsilon_high=epsilon_high if epsilon_high is not None else epsilon,
            delta=get("delta"),
            use_bias_correction_kl=get("use_bias_correction_kl"),
            sapo_temperature_pos=get("sapo_temperature_pos"),
            sapo_temperature_neg=get("sapo_temperature_neg"),
            vespo_k_pos=get("vespo_k_pos"),
            vespo_lambda_pos=get("vespo_lambda_pos"),
            vespo_k_neg=get("vespo_k_neg"),
            vespo_lambda_neg=get("vespo_lambda_neg"),
            off_policy_mask_threshold=get("off_policy_mask_threshold"),
            vllm_importance_sampling_correction=bool(
                get("use_vllm") and get("vllm_importance_sampling_correction")
            ),
            max_completion_length=get("max_completion_length"),
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=steps_per_generation,
            entropy_coef=get("entropy_coef"),
            top_entropy_quantile=get("top_entropy_quantile"),
            use_adaptive_entropy=get("use_adaptive_entropy"),
            router_aux_loss_coef=router_aux_loss_coef,
        )
