"""A micro-batch's loss terms: each response's term from its replayed log-probs (:class:`ResponseTerms`), and what
the micro-batch sums and reports of them (:class:`LossTally`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .errors import NonFiniteLossError
from .loss import GRPOLossSpec, LossNormalizer, ResponseMetrics, aggregate_metrics, response_loss
from .state_cache import CachedPrompt

__all__ = ["LossTally", "ResponseTerms", "raise_non_finite"]


class Reductions(Protocol):
    """The collectives the tally's metrics need (``Collectives``' reductions)."""

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor: ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


class StepCounters(Protocol):
    """Where the micro-batch is in training (``LossScaling``), for error messages."""

    micro_step: int
    global_step: int


@dataclass
class ResponseTerms:
    """Each response's loss term (:func:`~longstraw_trl.loss.response_loss`) from its replayed log-probs: its rows of
    the per-token inputs cut to the replayed length, the term checked finite (stopping before any backward
    otherwise), and exactly zero for a row without loss tokens.

    Args:
        spec: the loss.
        ctx: the micro-batch's normalisers (:func:`~longstraw_trl.loss.batch_loss_context`).
        inputs: the micro-batch (``advantages`` and, when present, the old, reference and sampler log-probs).
        counters: the trainer's steps (error messages).
        loss: a response's term and metrics (:func:`~longstraw_trl.loss.response_loss`).
    """

    spec: GRPOLossSpec
    ctx: LossNormalizer
    inputs: dict[str, Any]
    counters: StepCounters
    loss: Callable[..., tuple[torch.Tensor, ResponseMetrics]] = response_loss

    def __post_init__(self):
        self.old = self.inputs.get("old_per_token_logps")
        self.ref = self.inputs.get("ref_per_token_logps")
        self.sampling = self.inputs.get("sampling_per_token_logps")
        self.advantages = self.inputs["advantages"]

    def term(
        self,
        i: int,
        group: int,
        entry: CachedPrompt,
        length: int,
        logps: torch.Tensor,
        entropies: torch.Tensor,
    ) -> tuple[torch.Tensor, ResponseMetrics]:
        """Response ``i``'s term (differentiable in ``logps``, and in ``entropies`` with an entropy bonus) from its
        first ``length`` replayed positions; ``group`` and ``entry`` (its prompt) name it if it is not finite."""
        term, metrics = self.loss(
            self.spec,
            self.ctx,
            i,
            logps,
            _cut(self.old, i, length),
            _cut(self.ref, i, length),
            self.advantages[i],
            sampling_logps_i=_cut(self.sampling, i, length),
            entropies_i=entropies,
        )
        if not torch.isfinite(term.detach()):
            raise_non_finite(
                term, i, group, entry, length, logps, self.old, self.ref, self.advantages, self.counters
            )
        if self.ctx.lengths[i] == 0:
            term = term * 0.0
        return term, metrics

    def without_replay(self, i: int) -> tuple[torch.Tensor, ResponseMetrics]:
        """The term of response ``i``, which has no loss token, without replaying it: exactly zero (TRL's sums
        multiply it by the mask), and its metrics."""
        zeros = torch.zeros(1, device=self.inputs["completion_ids"].device)
        return self.loss(
            self.spec,
            self.ctx,
            i,
            zeros,
            _cut(self.old, i, 1),
            _cut(self.ref, i, 1),
            self.advantages[i],
            entropies_i=zeros,
        )


def _cut(x: torch.Tensor | None, i: int, length: int) -> torch.Tensor | None:
    return None if x is None else x[i, :length]


@dataclass
class LossTally:
    """What a micro-batch sums and reports: its loss (detached), every response's metrics, and the replays' time
    and tokens."""

    device: torch.device
    total: torch.Tensor = field(init=False)
    metrics: list[ResponseMetrics] = field(default_factory=list)
    replay_seconds: float = 0.0
    replay_tokens: int = 0

    def __post_init__(self):
        self.total = torch.zeros((), device=self.device)

    def add_constant(self, value: torch.Tensor) -> None:
        """A part of the loss no response carries (the router loss's captured prompt tokens)."""
        self.total = self.total + value

    def add(self, term: torch.Tensor, metrics: ResponseMetrics, replayed_tokens: int = 0) -> None:
        """A response's term (its value: the gradient is the replay's business) and metrics."""
        self.total = self.total + term.detach()
        self.metrics.append(metrics)
        self.replay_tokens += replayed_tokens

    def report_loss_metrics(self, spec: GRPOLossSpec, collectives: Reductions, sink: dict[str, list]) -> None:
        """TRL's metrics of the micro-batch, aggregated over processes, into ``sink``."""
        for name, value in aggregate_metrics(
            spec,
            self.metrics,
            reduce_sum=lambda t: collectives.reduce(t, reduction="sum"),
            gather=collectives.gather,
        ).items():
            sink[name].append(value)

    def report_replay_speed(self, sink: dict[str, list]) -> None:
        """The replays' seconds and tokens per second, into ``sink``."""
        sink["longstraw/replay_seconds"].append(self.replay_seconds)
        sink["longstraw/replay_tokens_per_second"].append(self.replay_tokens / max(self.replay_seconds, 1e-9))

    def bonus_entropy(self, spec: GRPOLossSpec) -> torch.Tensor | None:
        """With an entropy bonus, the ``[entropy sum, token count]`` of the tokens it acts on (TRL's adaptive
        entropy controller)."""
        if not spec.entropy_bonus_enabled:
            return None
        return torch.stack([m.bonus_entropy for m in self.metrics]).sum(0)


def raise_non_finite(
    term: torch.Tensor,
    i: int,
    g: int,
    entry: CachedPrompt,
    length: int,
    logps: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    advantages: torch.Tensor,
    scaling: StepCounters,
) -> None:
    """Stop before back-propagating a non-finite term, naming the inputs that are not finite."""
    suspects = []
    if not torch.isfinite(logps.detach()).all():
        suspects.append("the policy log-probs (diverged weights? lower the learning rate)")
    if old is not None and not torch.isfinite(old[i, :length]).all():
        suspects.append("the old-policy log-probs")
    if ref is not None and not torch.isfinite(ref[i, :length]).all():
        suspects.append("the reference log-probs")
    if not torch.isfinite(advantages[i]).all():
        suspects.append("the advantage (check the reward functions)")
    raise NonFiniteLossError(
        f"non-finite loss ({term.item()}) at global step {scaling.global_step + 1} (micro-step {scaling.micro_step}), "
        f"group {g} of the micro-batch (prompt {entry.key}, {entry.prompt_ids.numel()} tokens), response {i} "
        f"({length} tokens); non-finite inputs: {', '.join(suspects) or 'none (the loss terms overflowed)'}. "
        "Training stopped before back-propagating it."
    )
