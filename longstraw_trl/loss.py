"""TRL's GRPO policy loss, decomposed into one differentiable term per response.

LongStraw computes the policy loss one response at a time: response `i` is replayed under autograd on top of the
captured prompt state, its loss term is built here, `backward()` is called on it, and its graph is freed before
the next response. For that to train exactly like TRL, this module returns, for every response `i` of a
micro-batch of `B` completions, a scalar `loss_i` such that

    sum_i loss_i == GRPOTrainer._compute_loss(model, inputs)            (same micro-batch, same inputs)

up to float rounding of the final sum (the per-token math is the same sequence of torch ops as TRL's, on a
`[1, R]` slice instead of `[B, R]`), and therefore `sum_i d loss_i / d per_token_logps` is TRL's gradient.
`tests/test_loss_parity.py` checks value, gradient and logged metrics against TRL's real `_compute_loss`.

What the value equals, and how gradient accumulation enters (TRL 1.16, transformers 5.23, accelerate)
-----------------------------------------------------------------------------------------------------
`Trainer.training_step` calls `GRPOTrainer.compute_loss`, which ignores the Trainer's `num_items_in_batch`
argument and returns `_compute_loss(model, inputs)`. `GRPOTrainer.loss_is_scaled_for_ga = True`, so
`training_step` does *not* divide by the number of accumulation steps; GRPO's `compute_loss` override also skips
`Trainer.compute_loss`'s `average_tokens_across_devices` multiplication by `num_processes`; and the Trainer builds
its `Accelerator` with `GradientAccumulationPlugin(num_steps=1)`, so `accelerator.backward(loss)` divides by 1
(DeepSpeed gets `scale_wrt_gas=False`). Hence **the value backpropagated by `Trainer.training_step` is exactly
the value `_compute_loss` returns** (with `n_gpu <= 1`), and that is what `sum_i loss_i` equals. Distributed
data parallelism then *averages* gradients over processes.

All gradient-accumulation scaling is inside `_compute_loss`, and depends on the loss type. With
`ga = trainer.current_gradient_accumulation_steps` in train mode (the Trainer sets it to the number of
micro-batches in the current accumulation window, which is smaller than `gradient_accumulation_steps` for the
last, partial window of an epoch) and `ga = 1` in eval mode (`model.training == False`), `m` the loss mask
(`completion_mask`, times `tool_mask` when present) and `l` the per-token loss:

- `grpo`, `sapo`: `mean_b( sum_t l*m / max(sum_t m, 1) ) / ga`
- `bnpo`:         `sum_bt l*m / max(sum_bt m, 1) / ga`                  (local token count of the micro-batch)
- `dr_grpo`:      `sum_bt l*m / (B * max_completion_length) / ga`
- `luspo`:        `mean_b( sum_t l*m ) / ga`
- `dapo`, `cispo`, `vespo`: `sum_bt l*m / N`, with
  `N = max(num_items_in_batch, 1) / num_processes * ga / steps_per_generation` in train mode and
  `N = max(num_items_in_batch, 1) / num_processes` in eval mode. `num_items_in_batch` is the loss-mask token
  count of the whole *generation batch* (all `steps_per_generation` micro-batches) gathered over all processes
  (`_generate_and_score_completions`), so `N` is the mean per-process token count of one accumulation window.

plus, while the entropy bonus is enabled (`entropy_coef != 0` or `use_adaptive_entropy`),
`- c * sum_bt H*m' / max(sum_bt m', 1) / ga` with `c` the applied coefficient and `m' = m * E`, `E` the
high-entropy token mask when `top_entropy_quantile < 1` (which also multiplies the per-token loss), else `m' = m`.
`batch_loss_context` computes every one of these micro-batch-wide quantities once, from the masks.

Supported
---------
- `loss_type`: `grpo`, `bnpo`, `dr_grpo`, `dapo`, `cispo`, `sapo`, `luspo`, `vespo` (all of TRL 1.16's).
- `importance_sampling_level`: `token` and `sequence` (per-sequence mean log-ratio over the mask).
- `epsilon` / `epsilon_high` (asymmetric clipping; `epsilon_high` is CISPO's ε_max), `delta` (two-sided clipping),
  `sapo_temperature_*`, `vespo_k_*` / `vespo_lambda_*`.
- `beta != 0` with reference log-probs, with or without `use_bias_correction_kl`.
- `old_per_token_logps` absent (on-policy: TRL then uses `per_token_logps.detach()`).
- `off_policy_mask_threshold` (DeepSeek-V3.2 off-policy sequence mask; pass `sampling_logps_i` when the
  sampler's log-probs exist, else the old log-probs are used, as in TRL).
- vLLM importance-sampling correction (`use_vllm and vllm_importance_sampling_correction`): pass the
  `importance_sampling_ratio` row that TRL computes in `_generate_and_score_completions` (token `[R]` or
  sequence `[1]` level); it multiplies the per-token loss, or enters VESPO's gamma weights.
- `tool_mask` / `env_mask`: pass `completion_mask * tool_mask` as the mask (TRL does the same).
- Per-token advantages (`[R]` per response, TRL's `(B, T)` advantages for subclasses) besides the usual scalar.
- Entropy bonus (`entropy_coef != 0`): pass the differentiable per-token entropies of the response as
  `entropies_i`.
- `top_entropy_quantile < 1.0`: TRL's mask is a quantile over the entropies of the whole micro-batch (all
  processes), so it must be known before the first response's term: compute it once per micro-batch with
  [`high_entropy_mask`] (TRL's `get_high_entropy_mask`) from entropies without gradient (the trainer replays the
  micro-batch graph-free for them) and pass it as `batch_loss_context(entropy_mask=)`.
- `use_adaptive_entropy=True` (Skywork-OR1 controller): the caller keeps TRL's state (coefficient, entropy of the
  previous optimizer step, window sums). Per micro-batch: `batch_loss_context(entropy_coef=applied_entropy_coef(...))`;
  the window's `[entropy sum, token count]` is the sum of the responses' `ResponseMetrics.bonus_entropy`; at the
  optimizer-step boundary, summed over processes, it gives the new coefficient through [`adaptive_entropy_coef`].
- Train and eval mode (`training=` in `batch_loss_context`).

The MoE router loss
-------------------
The MoE router load-balancing loss (`router_aux_loss_coef != 0`) is not a function of the log-probs: it is not part
of `response_loss`. `GRPOLossSpec.router_aux_loss_coef` carries TRL's effective coefficient (resolved from the model
by `from_args(args, model=model)`), and `longstraw_trl.router_aux` builds each response's exact share of it.

Where the math lives
--------------------
TRL's per-token loss is inline in `GRPOTrainer._compute_loss`; `_per_token_terms` below replicates it line by
line (same op order, same broadcasting, on a one-row batch). TRL's own static helpers are imported and reused:
`GRPOTrainer.get_off_policy_mask`, `GRPOTrainer.get_gamma_weights` and (for the metrics)
`trl.trainer.utils.nanmin/nanmax`. `GRPOLossSpec` and the loss types live in `longstraw_trl.loss_spec`, the logged
metrics in `longstraw_trl.loss_metrics` (both re-exported here).

Padding
-------
Per-token inputs of response `i` may be given at the padded length `R` of the micro-batch (exactly TRL's
inputs) or truncated to any length `L >= ` the last loss-mask position of that row + 1 (padding tokens add zeros
to every sum). One corner case depends on padding in TRL itself: VESPO with vLLM IS correction sums
`log(importance_sampling_ratio)` over *all* positions, padding included; TRL's padded ratios are
`exp(0) = 1` unless `vllm_importance_sampling_clip_min > 1` (truncate modes) or `clip_max < 1` (mask modes).
Pass length-`R` rows if you need TRL's behaviour in that corner too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from .loss_metrics import ResponseMetrics, add_response_metrics, aggregate_metrics
from .loss_spec import CLIPPED_LOSS_TYPES, LOSS_TYPES, TOKEN_NORMALIZED_LOSS_TYPES, GRPOLossSpec

__all__ = [
    "LOSS_TYPES",
    "CLIPPED_LOSS_TYPES",
    "TOKEN_NORMALIZED_LOSS_TYPES",
    "GRPOLossSpec",
    "LossNormalizer",
    "ResponseMetrics",
    "adaptive_entropy_coef",
    "aggregate_metrics",
    "applied_entropy_coef",
    "batch_loss",
    "batch_loss_context",
    "high_entropy_mask",
    "loss_lengths",
    "response_loss",
]


@dataclass(frozen=True)
class LossNormalizer:
    """
    Everything a response's loss term needs from the whole micro-batch, computed once from its loss mask by
    [`batch_loss_context`]. Treat it as read-only.

    Parameters:
        spec (`GRPOLossSpec`):
            The loss specification this context was built for.
        mask (`torch.Tensor` of shape `(B, R)`):
            The micro-batch loss mask (`completion_mask`, times `tool_mask` if any), as given.
        num_responses (`int`):
            `B`, the number of completions in the micro-batch (TRL's `per_token_loss.size(0)`).
        lengths (`tuple[int, ...]`):
            Per response, the last loss-mask position + 1: the shortest length at which its per-token inputs may
            be passed.
        local_num_tokens (`torch.Tensor`, scalar):
            `mask.sum().clamp(min=1.0)`: the `bnpo` and entropy-bonus denominator.
        ga_normalizer (`int` or `float`):
            `current_gradient_accumulation_steps` in train mode, `1.0` in eval mode.
        token_normalizer (`torch.Tensor` or `None`):
            The `dapo`/`cispo`/`vespo` denominator `N` (see the module docstring); `None` for other loss types.
        training (`bool`):
            Train mode (`model.training` in TRL).
        entropy_mask (`torch.Tensor` of shape `(B, R)` or `None`):
            TRL's high-entropy token mask (`top_entropy_quantile < 1`), as given; `None` otherwise.
        entropy_num_tokens (`torch.Tensor`, scalar):
            `(mask * entropy_mask).sum().clamp(min=1.0)`: the entropy-bonus denominator (`local_num_tokens` without
            an entropy mask).
        entropy_coef (`float`):
            The entropy-bonus coefficient this micro-batch applies (TRL's `apply_coef`).
    """

    spec: GRPOLossSpec
    mask: torch.Tensor
    num_responses: int
    lengths: tuple[int, ...]
    local_num_tokens: torch.Tensor
    ga_normalizer: int | float
    token_normalizer: torch.Tensor | None
    training: bool
    entropy_mask: torch.Tensor | None = None
    entropy_num_tokens: torch.Tensor | None = None
    entropy_coef: float = 0.0


def loss_lengths(mask: torch.Tensor) -> tuple[int, ...]:
    """Per row of a `(B, R)` loss mask, its last loss position + 1 (0 without loss tokens): one host sync."""
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return tuple(int(v) for v in (positions * (mask != 0)).amax(dim=1).tolist()) if mask.numel() else ()


def batch_loss_context(
    spec: GRPOLossSpec,
    completion_mask: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int | None = None,
    training: bool = True,
    entropy_mask: torch.Tensor | None = None,
    entropy_coef: float | None = None,
) -> LossNormalizer:
    """Compute the micro-batch-wide normalizers of TRL's GRPO loss from the loss mask.

    Args:
        spec (`GRPOLossSpec`):
            The loss specification.
        completion_mask (`torch.Tensor` of shape `(B, R)`):
            The loss mask of the micro-batch: TRL's `completion_mask`, times `tool_mask` when present.
        num_items_in_batch (`torch.Tensor` or `int`, *optional*):
            TRL's `inputs["num_items_in_batch"]`: the loss-mask token count of the whole generation batch, summed
            over all processes. Required for `dapo`, `cispo` and `vespo`.
        num_processes (`int`, *optional*, defaults to `1`):
            `accelerator.num_processes`.
        gradient_accumulation_steps (`int`, *optional*):
            The Trainer's `current_gradient_accumulation_steps` (micro-batches in the current accumulation
            window). Defaults to `spec.gradient_accumulation_steps`. Ignored in eval mode.
        training (`bool`, *optional*, defaults to `True`):
            TRL's `mode == "train"` (`model.training`). In eval mode nothing is scaled for accumulation.
        entropy_mask (`torch.Tensor` of shape `(B, R)`, *optional*):
            TRL's high-entropy token mask of the micro-batch ([`high_entropy_mask`]); required when
            `spec.top_entropy_quantile < 1`, and only then allowed.
        entropy_coef (`float`, *optional*):
            The entropy-bonus coefficient to apply (TRL's `apply_coef`): required with `spec.use_adaptive_entropy`
            (see [`applied_entropy_coef`]); defaults to `spec.entropy_coef` otherwise.

    Returns:
        [`LossNormalizer`]
    """
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be (B, R), got shape {tuple(completion_mask.shape)}.")
    mask = completion_mask
    num_responses = mask.size(0)
    ga = (
        spec.gradient_accumulation_steps
        if gradient_accumulation_steps is None
        else gradient_accumulation_steps
    )
    ga_normalizer = ga if training else 1.0  # TRL: no accumulation in eval

    lengths = loss_lengths(mask)

    token_normalizer = None
    if spec.loss_type in TOKEN_NORMALIZED_LOSS_TYPES:
        if num_items_in_batch is None:
            raise ValueError(
                f"loss_type={spec.loss_type!r} is normalized by `num_items_in_batch` (the loss-mask token count of "
                "the generation batch over all processes); pass it to batch_loss_context."
            )
        if not isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = torch.tensor(num_items_in_batch, device=mask.device)
        # Same ops as TRL's `_compute_loss`.
        token_normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        if training:
            token_normalizer = token_normalizer * ga / spec.steps_per_generation

    if (entropy_mask is not None) != (spec.top_entropy_quantile < 1.0):
        raise ValueError(
            f"top_entropy_quantile={spec.top_entropy_quantile}: pass entropy_mask (the high-entropy token mask of the "
            "micro-batch, see high_entropy_mask) exactly when it is below 1."
        )
    if entropy_mask is not None and entropy_mask.shape != mask.shape:
        raise ValueError(f"entropy_mask has shape {tuple(entropy_mask.shape)}, the mask {tuple(mask.shape)}.")
    if entropy_coef is None:
        if spec.use_adaptive_entropy:
            raise ValueError(
                "use_adaptive_entropy=True: pass the coefficient this micro-batch applies as entropy_coef "
                "(applied_entropy_coef of the controller state)."
            )
        entropy_coef = spec.entropy_coef
    local_num_tokens = mask.sum().clamp(min=1.0)
    entropy_num_tokens = (
        local_num_tokens if entropy_mask is None else (mask * entropy_mask).sum().clamp(min=1.0)
    )
    return LossNormalizer(
        spec=spec,
        mask=mask,
        num_responses=num_responses,
        lengths=lengths,
        local_num_tokens=local_num_tokens,
        ga_normalizer=ga_normalizer,
        token_normalizer=token_normalizer,
        training=training,
        entropy_mask=entropy_mask,
        entropy_num_tokens=entropy_num_tokens,
        entropy_coef=float(entropy_coef),
    )


def high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float, accelerator: Any = None
) -> torch.Tensor:
    """TRL's high-entropy token mask of a micro-batch: `GRPOTrainer.get_high_entropy_mask` (TRL's own code, called).

    Tokens whose entropy is at or above the `1 - top_entropy_quantile` quantile of the loss tokens' entropies,
    gathered over all processes of `accelerator` (this process only when `None`), and inside `mask`.

    Args:
        entropies (`torch.Tensor` of shape `(B, R)`):
            Per-token entropies of the micro-batch (no gradient needed: the mask is a comparison).
        mask (`torch.Tensor` of shape `(B, R)`):
            The loss mask.
        top_entropy_quantile (`float`):
            `args.top_entropy_quantile`.
        accelerator (`accelerate.Accelerator`, *optional*):
            For the cross-process gather (`pad_across_processes`, `gather`).

    Returns:
        `torch.Tensor`: boolean `(B, R)`.
    """
    accelerator = accelerator if accelerator is not None else _SingleProcess()
    owner = SimpleNamespace(accelerator=accelerator)
    return GRPOTrainer.get_high_entropy_mask(owner, entropies, mask, 1 - top_entropy_quantile)


class _SingleProcess:
    """The two collectives `get_high_entropy_mask` uses, on one process."""

    @staticmethod
    def pad_across_processes(tensor, dim=0, pad_index=0):
        return tensor

    @staticmethod
    def gather(tensor):
        return tensor


def applied_entropy_coef(
    entropy_coef: float, last_world_entropy: float, entropy_target: float, adaptive: bool
) -> float:
    """The coefficient TRL's `_compute_loss` applies (`apply_coef`): under adaptive control, `entropy_coef` only while
    the entropy measured at the previous optimizer step is at or below `entropy_target` (never before the first)."""
    if adaptive:
        return entropy_coef if last_world_entropy <= entropy_target else 0.0
    return entropy_coef


def adaptive_entropy_coef(
    entropy_coef: float,
    world_entropy: float,
    *,
    entropy_target: float,
    entropy_coef_delta: float,
    entropy_coef_min: float,
    entropy_coef_max: float,
) -> float:
    """TRL's adaptive entropy update at an optimizer step: `+delta` (up to the max) when the window's entropy is at or
    below the target, `-delta` (down to the min) otherwise. `world_entropy` is the token-weighted mean entropy of the
    accumulation window over all processes, on the tokens the bonus acts on (see [`ResponseMetrics`])."""
    if world_entropy <= entropy_target:
        return min(entropy_coef + entropy_coef_delta, entropy_coef_max)
    return max(entropy_coef - entropy_coef_delta, entropy_coef_min)


def _as_row(
    x: torch.Tensor | float | None, length: int, name: str, device, dtype=None
) -> torch.Tensor | None:
    """Shape a per-response input as TRL's one-row batch slice: `[1, length]` (per token) or `[1, 1]`."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(x, device=device, dtype=dtype if dtype is not None else torch.get_default_dtype())
    x = x.reshape(1, -1)
    if x.size(1) == 1 or x.size(1) == length:
        return x
    if x.size(1) > length:
        return x[:, :length]
    raise ValueError(f"{name} has {x.size(1)} positions, fewer than the {length} of per_token_logps_i.")


def _per_token_terms(
    spec, per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, **extra
):
    """TRL 1.16 `GRPOTrainer._compute_loss`, from `get_off_policy_mask` to the KL term, on a one-row batch.

    Replicated line by line (TRL's code is inline); every tensor is `[1, L]` or `[1, 1]` exactly like a row of
    TRL's `[B, T]` / `[B, 1]` tensors, so broadcasting and op order are TRL's. Returns the per-token loss and the
    intermediate tensors TRL logs metrics from.
    """
    sampling_per_token_logps = extra.get("sampling_per_token_logps")
    importance_sampling_ratio = extra.get("importance_sampling_ratio")
    entropy_mask = extra.get("entropy_mask")

    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

    if spec.off_policy_mask_threshold is not None:
        if sampling_per_token_logps is None:
            sampling_per_token_logps = old_per_token_logps
        off_policy_mask = GRPOTrainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=sampling_per_token_logps,
            mask=mask,
            off_policy_threshold=spec.off_policy_mask_threshold,
        )

    log_ratio = per_token_logps - old_per_token_logps
    if spec.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:  # "sequence"
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)

    coef_1 = torch.exp(log_importance_weights)

    per_token_kl = None
    if spec.beta != 0.0:
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        )
        if spec.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    phi_seq = None
    if spec.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=spec.epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif spec.loss_type in CLIPPED_LOSS_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - spec.epsilon_low, 1 + spec.epsilon_high)
        if spec.delta is not None:  # two-sided clipping; TRL's clip metrics then see the clamped coef_1
            coef_1 = torch.clamp(coef_1, max=spec.delta)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif spec.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    else:  # "vespo"
        phi_seq = GRPOTrainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=importance_sampling_ratio,
            k_pos=spec.vespo_k_pos,
            lambda_pos=spec.vespo_lambda_pos,
            k_neg=spec.vespo_k_neg,
            lambda_neg=spec.vespo_lambda_neg,
        )
        per_token_loss = -phi_seq * advantages * per_token_logps

    if spec.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask

    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask

    if spec.vllm_importance_sampling_correction and spec.loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio

    if spec.beta != 0.0:
        per_token_loss = per_token_loss + spec.beta * per_token_kl

    return per_token_loss, coef_1, per_token_kl, phi_seq


def response_loss(
    spec: GRPOLossSpec,
    ctx: LossNormalizer,
    i: int,
    per_token_logps_i: torch.Tensor,
    old_logps_i: torch.Tensor | None,
    ref_logps_i: torch.Tensor | None,
    advantage_i: torch.Tensor | float,
    mask_i: torch.Tensor | None = None,
    *,
    sampling_logps_i: torch.Tensor | None = None,
    importance_sampling_ratio_i: torch.Tensor | None = None,
    entropies_i: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ResponseMetrics]:
    """The loss term of response `i`: summed over the micro-batch, TRL's `_compute_loss` value.

    Differentiable in `per_token_logps_i` (and `entropies_i` when the entropy bonus is on); everything else is
    treated as data. Per-token inputs are `[R]` (the micro-batch's padded length) or `[L]` with
    `ctx.lengths[i] <= L <= R`; all of them must have the same length.

    Args:
        spec (`GRPOLossSpec`):
            The loss specification (must be the one `ctx` was built with).
        ctx (`LossNormalizer`):
            From [`batch_loss_context`] for this micro-batch.
        i (`int`):
            Row of the response in the micro-batch.
        per_token_logps_i (`torch.Tensor` of shape `[L]`):
            Current-policy log-probs of the response tokens, with autograd.
        old_logps_i (`torch.Tensor` of shape `[L]`, *optional*):
            TRL's `old_per_token_logps` row; `None` when TRL has none (then `per_token_logps_i.detach()`).
        ref_logps_i (`torch.Tensor` of shape `[L]`, *optional*):
            Reference-model log-probs; required when `spec.beta != 0`.
        advantage_i (`torch.Tensor` or `float`):
            The response's advantage (scalar), or per-token advantages `[L]`.
        mask_i (`torch.Tensor` of shape `[L]`, *optional*):
            The response's loss-mask row; defaults to `ctx.mask[i]` (must equal it when given).
        sampling_logps_i (`torch.Tensor` of shape `[L]`, *optional*):
            Sampler log-probs (TRL's `sampling_per_token_logps`), used by the off-policy mask when given.
        importance_sampling_ratio_i (`torch.Tensor` of shape `[L]` or `[1]`, *optional*):
            TRL's vLLM `importance_sampling_ratio` row; required when `spec.vllm_importance_sampling_correction`.
        entropies_i (`torch.Tensor` of shape `[L]`, *optional*):
            Per-token entropies of the policy; required while the entropy bonus is enabled (differentiable when
            the applied `ctx.entropy_coef` is non-zero), otherwise only used for the `entropy` metric.

    Returns:
        `tuple[torch.Tensor, ResponseMetrics]`: the scalar loss term and the response's metric shares.
    """
    if per_token_logps_i.dim() != 1:
        per_token_logps_i = per_token_logps_i.reshape(-1)
    _check_response_inputs(
        spec, ctx, i, per_token_logps_i.size(0), ref_logps_i, importance_sampling_ratio_i, entropies_i
    )
    rows = _ResponseRows.of(
        ctx,
        i,
        per_token_logps_i,
        mask_i,
        advantage_i,
        old_logps_i,
        ref_logps_i,
        sampling_logps_i,
        importance_sampling_ratio_i,
        entropies_i,
    )
    per_token_loss, coef_1, per_token_kl, phi_seq = _per_token_terms(
        spec,
        rows.logps,
        rows.old,
        rows.ref,
        rows.advantages,
        rows.mask,
        sampling_per_token_logps=rows.sampling,
        importance_sampling_ratio=rows.is_ratio if spec.vllm_importance_sampling_correction else None,
        entropy_mask=rows.entropy_mask,
    )
    loss, policy = _aggregated_loss(spec, ctx, per_token_loss, rows.mask)
    bonus_entropy = None
    if spec.entropy_bonus_enabled:
        loss, bonus_entropy = _with_entropy_bonus(ctx, loss, rows)
    metrics = ResponseMetrics(policy_loss=policy.detach(), bonus_entropy=bonus_entropy)
    add_response_metrics(
        metrics,
        spec,
        ctx.mask.size(1),
        rows.mask,
        rows.advantages,
        advantage_i,
        rows.entropies,
        coef_1,
        per_token_kl,
        phi_seq,
    )
    return loss, metrics


def _check_response_inputs(
    spec: GRPOLossSpec,
    ctx: LossNormalizer,
    i: int,
    length: int,
    ref_logps_i: torch.Tensor | None,
    importance_sampling_ratio_i: torch.Tensor | None,
    entropies_i: torch.Tensor | None,
) -> None:
    """Refuse a response's inputs that :func:`response_loss` cannot turn into TRL's term, saying what is missing."""
    if ctx.spec != spec:
        raise ValueError("ctx was built by batch_loss_context for a different GRPOLossSpec.")
    if not ctx.lengths[i] <= length <= ctx.mask.size(1):
        raise ValueError(
            f"per_token_logps_i of response {i} has {length} positions; it needs between {ctx.lengths[i]} (its last "
            f"loss token + 1) and {ctx.mask.size(1)} (the padded length)."
        )
    if spec.beta != 0.0 and ref_logps_i is None:
        raise ValueError("beta != 0 needs the reference log-probs (ref_logps_i).")
    if spec.vllm_importance_sampling_correction and importance_sampling_ratio_i is None:
        raise ValueError("vLLM importance-sampling correction is on: pass importance_sampling_ratio_i.")
    if spec.entropy_bonus_enabled and entropies_i is None:
        raise ValueError(
            "the entropy bonus (entropy_coef != 0 or use_adaptive_entropy) needs the per-token entropies of the "
            "response (entropies_i)."
        )


@dataclass(frozen=True)
class _ResponseRows:
    """A response's per-token inputs as TRL's one-row batch slices (`[1, L]` or `[1, 1]`, see `_as_row`)."""

    logps: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    sampling: torch.Tensor | None
    is_ratio: torch.Tensor | None
    entropies: torch.Tensor | None
    entropy_mask: torch.Tensor | None

    @classmethod
    def of(
        cls, ctx, i, logps_i, mask_i, advantage_i, old_i, ref_i, sampling_i, is_ratio_i, entropies_i
    ) -> _ResponseRows:
        length, device = logps_i.size(0), logps_i.device
        logps = logps_i.reshape(1, -1)
        mask = _as_row(ctx.mask[i] if mask_i is None else mask_i, length, "mask_i", device)
        if mask.size(1) != length:
            raise ValueError(f"mask_i has {mask.size(1)} positions, per_token_logps_i has {length}.")
        entropy_mask = ctx.entropy_mask
        return cls(
            logps=logps,
            mask=mask,
            advantages=_as_row(advantage_i, length, "advantage_i", device, dtype=logps.dtype),
            old=_as_row(old_i, length, "old_logps_i", device),
            ref=_as_row(ref_i, length, "ref_logps_i", device),
            sampling=_as_row(sampling_i, length, "sampling_logps_i", device),
            is_ratio=_as_row(is_ratio_i, length, "importance_sampling_ratio_i", device),
            entropies=_as_row(entropies_i, length, "entropies_i", device),
            entropy_mask=None
            if entropy_mask is None
            else _as_row(entropy_mask[i], length, "entropy_mask", device),
        )


def _aggregated_loss(
    spec: GRPOLossSpec, ctx: LossNormalizer, per_token_loss: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's aggregation of the per-token loss, restricted to one row (the module docstring's formulas): the loss
    term and TRL's `policy_loss` share."""
    masked_sum = (per_token_loss * mask).sum(-1)  # [1]
    if spec.loss_type in ("grpo", "sapo"):
        policy = (masked_sum / mask.sum(-1).clamp(min=1.0)).sum() / ctx.num_responses
        loss = policy / ctx.ga_normalizer
    elif spec.loss_type == "bnpo":
        policy = masked_sum.sum() / ctx.local_num_tokens
        loss = policy / ctx.ga_normalizer
    elif spec.loss_type == "dr_grpo":
        policy = masked_sum.sum() / (ctx.num_responses * spec.max_completion_length)
        loss = policy / ctx.ga_normalizer
    elif spec.loss_type in TOKEN_NORMALIZED_LOSS_TYPES:
        loss = policy = masked_sum.sum() / ctx.token_normalizer
    else:  # "luspo"
        policy = masked_sum.sum() / ctx.num_responses
        loss = policy / ctx.ga_normalizer
    return loss, policy


def _with_entropy_bonus(
    ctx: LossNormalizer, loss: torch.Tensor, rows: _ResponseRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss with TRL's entropy bonus, `(entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) /
    accumulation_factor` times the applied coefficient, taken off; and the row's `[entropy sum, token count]`."""
    mask = rows.mask
    effective_mask = mask if rows.entropy_mask is None else mask * rows.entropy_mask
    entropy_sum = (rows.entropies * effective_mask).sum()
    entropy_loss = entropy_sum / ctx.entropy_num_tokens / ctx.ga_normalizer
    loss = loss - ctx.entropy_coef * entropy_loss
    return loss, torch.stack([entropy_sum.detach(), effective_mask.sum().to(entropy_sum.dtype)])


def batch_loss(
    spec: GRPOLossSpec,
    ctx: LossNormalizer,
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    ref_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    sampling_per_token_logps: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    backward: bool = False,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum [`response_loss`] over the rows of `[B, R]` tensors (TRL's `inputs` layout) and aggregate the metrics.

    A convenience for tests and non-streaming callers. With `backward=True` each response's term is
    back-propagated immediately (as the streaming trainer does) and the returned loss is detached.

    Returns:
        `tuple[torch.Tensor, dict[str, float]]`: the summed loss (TRL's `_compute_loss` value) and the metrics of
        [`aggregate_metrics`].
    """

    def row(x, b):
        return None if x is None else x[b]

    total = None
    all_metrics = []
    for b in range(ctx.num_responses):
        term, metrics = response_loss(
            spec,
            ctx,
            b,
            per_token_logps[b],
            row(old_per_token_logps, b),
            row(ref_per_token_logps, b),
            advantages[b],
            sampling_logps_i=row(sampling_per_token_logps, b),
            importance_sampling_ratio_i=row(importance_sampling_ratio, b),
            entropies_i=row(entropies, b),
        )
        if backward:
            term.backward()
            term = term.detach()
        total = term if total is None else total + term
        all_metrics.append(metrics)
    return total, aggregate_metrics(spec, all_metrics, reduce_sum=reduce_sum, gather=gather)
