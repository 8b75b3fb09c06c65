"""The metrics TRL's `_compute_loss` logs, as shares of one response (:class:`ResponseMetrics`,
:func:`add_response_metrics`) and combined over a micro-batch and the processes (:func:`aggregate_metrics`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from trl.trainer.utils import nanmax, nanmin

from .loss_spec import CLIPPED_LOSS_TYPES, GRPOLossSpec

__all__ = ["ResponseMetrics", "add_response_metrics", "aggregate_metrics"]


@dataclass
class ResponseMetrics:
    """
    One response's share of the metrics TRL logs from `_compute_loss`. Combine the responses of a micro-batch with
    [`aggregate_metrics`].

    Parameters:
        sums (`dict[str, torch.Tensor]`):
            Numerators of TRL's `global_masked_mean` metrics (`kl`, `entropy`, `clip_ratio/low_mean`, ...).
        counts (`dict[str, torch.Tensor]`):
            Their denominators (masked token count, or 1 per sequence for sequence-level quantities).
        seq_values (`dict[str, torch.Tensor]`):
            Per-sequence values (shape `[1]`) that TRL reduces with `nanmin` / `nanmax` over the micro-batch
            (`clip_ratio/low_min`, `clip_ratio/high_max`). NaN for a response without loss tokens, as in TRL.
        policy_loss (`torch.Tensor`):
            This response's share of TRL's `policy_loss` metric (the loss before the entropy bonus, and for
            `grpo`/`bnpo`/`dr_grpo`/`sapo`/`luspo` before the division by `ga`). TRL logs it only when the entropy
            bonus is enabled.
        bonus_entropy (`torch.Tensor` or `None`):
            `[sum_t H*m_eff, sum_t m_eff]` of this response (detached; `m_eff` the loss mask times the entropy
            mask), while the entropy bonus is enabled: summed over an accumulation window and all processes, the
            entropy TRL's adaptive controller compares with `entropy_target`.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_values: dict[str, torch.Tensor] = field(default_factory=dict)
    policy_loss: torch.Tensor | None = None
    bonus_entropy: torch.Tensor | None = None


def add_response_metrics(
    metrics: ResponseMetrics,
    spec: GRPOLossSpec,
    padded_length: int,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    advantage_i: torch.Tensor | float,
    entropies: torch.Tensor | None,
    coef_1: torch.Tensor,
    per_token_kl: torch.Tensor | None,
    phi_seq: torch.Tensor | None,
) -> None:
    """One response's shares of TRL's logged metrics (KL, entropy, the loss type's clip ratios), from its one-row
    tensors (``mask``, ``advantages``, ``entropies``: `[1, L]` or `[1, 1]`), the advantage as given (``advantage_i``:
    a per-token advantage has more than one element) and the micro-batch's padded length."""
    # TRL's metric helpers treat a `[B, 1]` tensor as one value per sequence. Which tensors have one column in TRL
    # (a truncated row cannot tell by its shape): all of them when the padded length R is 1; otherwise, with one
    # advantage per sequence, `phi_seq` and, at sequence level, the clip indicators. (A per-token advantage is
    # recognised by having more than one element.)
    one_column = padded_length == 1
    per_token_advantages = isinstance(advantage_i, torch.Tensor) and advantage_i.numel() > 1
    clip_per_seq = one_column or (spec.importance_sampling_level == "sequence" and not per_token_advantages)
    if per_token_kl is not None:
        _masked_metric(metrics, "kl", per_token_kl, mask, one_column)
    if entropies is not None:
        _masked_metric(metrics, "entropy", entropies, mask, one_column)
    if spec.loss_type in CLIPPED_LOSS_TYPES:
        is_low_clipped = (coef_1 < 1 - spec.epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + spec.epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        _masked_metric(metrics, "clip_ratio/low_mean", is_low_clipped.float(), mask, clip_per_seq)
        _masked_metric(metrics, "clip_ratio/high_mean", is_high_clipped.float(), mask, clip_per_seq)
        _masked_metric(metrics, "clip_ratio/region_mean", is_region_clipped.float(), mask, clip_per_seq)
        _seq_metric(metrics, "clip_ratio/low_min", is_low_clipped.float(), mask, clip_per_seq)
        _seq_metric(metrics, "clip_ratio/high_max", is_high_clipped.float(), mask, clip_per_seq)
    elif spec.loss_type == "cispo":
        is_cispo_clipped = (coef_1 > spec.epsilon_high) & (advantages > 0)
        _masked_metric(metrics, "cispo_clip_ratio", is_cispo_clipped.float(), mask, clip_per_seq)
    elif spec.loss_type == "vespo":
        _masked_metric(metrics, "vespo/phi_seq_mean", phi_seq, mask, one_column or not per_token_advantages)


def _masked_metric(
    metrics: ResponseMetrics, name: str, x: torch.Tensor, mask: torch.Tensor, per_seq: bool
) -> None:
    """One row's share of TRL's `global_masked_mean(x)`.

    TRL branches on `x.shape[1] == 1`; a row here may be truncated, so the caller says whether TRL's `[B, *]`
    tensor has one column (`per_seq`).
    """
    x = x.detach()
    if per_seq:  # TRL: `x.sum()` over one value per sequence, counted once per sequence
        metrics.sums[name] = x.sum()
        metrics.counts[name] = torch.tensor(float(x.shape[0]), device=x.device)
    else:
        metrics.sums[name] = (x * mask).sum()
        metrics.counts[name] = mask.sum().float()


def _seq_metric(
    metrics: ResponseMetrics, name: str, x: torch.Tensor, mask: torch.Tensor, per_seq: bool
) -> None:
    """One row of TRL's `masked_seq_mean(x)` (NaN for a row without loss tokens, as in TRL)."""
    x = x.detach()
    metrics.seq_values[name] = x.squeeze(1) if per_seq else (x * mask).sum(-1) / mask.sum(-1)


def aggregate_metrics(
    spec: GRPOLossSpec,
    metrics: Sequence[ResponseMetrics],
    *,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Combine the responses of one micro-batch into the values TRL's `_compute_loss` appends to `_metrics[mode]`.

    Args:
        spec (`GRPOLossSpec`):
            The loss specification.
        metrics (`Sequence[ResponseMetrics]`):
            The metrics of every response of the micro-batch (from [`response_loss`]).
        reduce_sum (`Callable`, *optional*):
            Cross-process sum, e.g. `lambda t: accelerator.reduce(t, reduction="sum")`. Identity by default.
        gather (`Callable`, *optional*):
            Cross-process gather, e.g. `accelerator.gather`. Identity by default.

    Returns:
        `dict[str, float]`: keyed by TRL's metric names (`policy_loss` only when the entropy bonus is on,
        `kl` only when `beta != 0`, `entropy` only when entropies were passed, then the loss type's clip metrics).
        TRL also logs `entropy_coef` (the controller's value, at optimizer-step boundaries) and `aux_loss` (the
        trainer logs it); those are not here.
    """
    reduce_sum = reduce_sum or (lambda t: t)
    gather = gather or (lambda t: t)
    if not metrics:
        return {}
    out: dict[str, float] = {}
    if spec.entropy_bonus_enabled:
        policy_loss = torch.stack([m.policy_loss for m in metrics]).sum()
        out["policy_loss"] = gather(policy_loss).nanmean().item()
    names = list(metrics[0].sums)
    for m in metrics[1:]:
        if list(m.sums) != names:
            raise ValueError(
                "Responses of one micro-batch report different metrics (entropies given for some only?)."
            )
    for name in names:
        local_sum = torch.stack([m.sums[name] for m in metrics]).sum()
        local_count = torch.stack([m.counts[name] for m in metrics]).sum()
        totals = reduce_sum(torch.stack([local_sum, local_count.to(local_sum.dtype)]))
        out[name] = (totals[0] / totals[1].clamp(min=1.0)).item()
    for name in metrics[0].seq_values:
        values = gather(torch.cat([m.seq_values[name] for m in metrics]))
        out[name] = (nanmin(values) if name.endswith("_min") else nanmax(values)).item()
    return out
