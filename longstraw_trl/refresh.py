"""When to re-capture a prompt state that an optimizer step has made stale.

A captured :class:`~longstraw_trl.PromptState` holds what the prompt looked like to the weights it was captured
with. After an optimizer step it is *stale*: replaying a response on it gives log-probs (and gradients) of a model
whose prompt path lags behind. Re-capturing (re-prefilling the whole prompt) is exact but costs a full prefill of P
tokens; reusing the stale state is free but approximate. :class:`RefreshPolicy` decides, every time a state is
needed, from its *age* (optimizer steps since its capture):

- ``"recapture"``: every stale state is re-captured;
- ``"reuse"``: a state is reused while ``age <= interval``, then re-captured;
- ``"adaptive"``: like ``"reuse"``, except that every ``probe_period``-th stale use re-captures and *probes*: the
  trainer replays one response on both the stale and the fresh state and reports the mean absolute difference of its
  token log-probs (the drift, nats/token) with :meth:`RefreshPolicy.record_drift`. Above ``drift_threshold`` the
  interval is halved, otherwise it grows by one, capped at ``max_interval`` (additive increase, multiplicative
  decrease).

The policy holds no tensors; its counters, interval and drift history are saved with the Trainer's checkpoints
(:meth:`state_dict`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FRESH, REUSE, RECAPTURE, PROBE = "fresh", "reuse", "recapture", "probe"
ACTIONS = (FRESH, REUSE, RECAPTURE, PROBE)


@dataclass
class RefreshDecision:
    """What to do with one prompt state now.

    Attributes:
        action: ``"fresh"`` (captured with the current weights: use it), ``"reuse"`` (stale, use it anyway),
            ``"recapture"`` (stale: re-prefill) or ``"probe"`` (stale: re-prefill and measure the drift).
        age: optimizer steps since the state was captured.
        interval: the reuse interval the decision was taken against.
    """

    action: str
    age: int
    interval: int

    @property
    def needs_capture(self) -> bool:
        return self.action in (RECAPTURE, PROBE)


class RefreshPolicy:
    """Decides between reusing and re-capturing stale prompt states (see the module docstring).

    Args:
        policy: ``"recapture"``, ``"reuse"`` or ``"adaptive"``.
        interval: optimizer steps after its capture during which a state may be reused (starting value for
            ``"adaptive"``).
        drift_threshold: ``"adaptive"``: drift (mean absolute log-prob difference) above which the interval narrows.
        probe_period: ``"adaptive"``: probe on every k-th stale use.
        max_interval: ``"adaptive"``: upper bound of the interval.
    """

    def __init__(
        self,
        policy: str = "recapture",
        interval: int = 1,
        drift_threshold: float = 0.02,
        probe_period: int = 4,
        max_interval: int = 16,
    ):
        if policy not in ("recapture", "reuse", "adaptive"):
            raise ValueError(f"refresh policy must be 'recapture', 'reuse' or 'adaptive', got {policy!r}")
        if interval < 0 or max_interval < 0 or probe_period < 1:
            raise ValueError("interval and max_interval must be >= 0 and probe_period >= 1")
        self.policy = policy
        self.interval = min(interval, max_interval) if policy == "adaptive" else interval
        self.drift_threshold = drift_threshold
        self.probe_period = probe_period
        self.max_interval = max_interval
        self.stale_uses = 0  # stale decisions so far (the probe clock of "adaptive")
        self.counts = dict.fromkeys(ACTIONS, 0)
        self.last_drift: float | None = None
        self.drifts: list[float] = []  # every drift recorded, in order (checkpointed with the rest)

    def decide(self, age: int) -> RefreshDecision:
        """The action for a state captured ``age`` optimizer steps ago (``age == 0``: captured with these weights)."""
        if age < 0:
            raise ValueError(f"age must be >= 0, got {age}")
        if age == 0:
            action = FRESH
        elif self.policy == "recapture":
            action = RECAPTURE
        else:
            self.stale_uses += 1
            if self.policy == "adaptive" and self.stale_uses % self.probe_period == 0:
                action = PROBE
            else:
                action = REUSE if age <= self.interval else RECAPTURE
        self.counts[action] += 1
        return RefreshDecision(action, age, self.interval)

    def record_drift(self, drift: float) -> int:
        """Feed the drift measured by a probe; returns the new interval (``"adaptive"`` adapts it)."""
        self.last_drift = float(drift)
        self.drifts.append(self.last_drift)
        if self.policy == "adaptive":
            old = self.interval
            if drift > self.drift_threshold:
                self.interval = self.interval // 2
            else:
                self.interval = min(self.interval + 1, self.max_interval)
            logger.info(
                "LongStraw refresh: drift %.4g nats/token %s threshold %.4g -> reuse interval %d -> %d",
                drift,
                ">" if drift > self.drift_threshold else "<=",
                self.drift_threshold,
                old,
                self.interval,
            )
        return self.interval

    # --- checkpointing ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "policy": self.policy,
            "interval": self.interval,
            "stale_uses": self.stale_uses,
            "counts": dict(self.counts),
            "last_drift": self.last_drift,
            "drifts": list(self.drifts),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("policy", self.policy) != self.policy:
            logger.warning(
                "LongStraw refresh: checkpoint was saved with refresh_policy=%r, now %r; keeping the new policy's "
                "interval",
                state.get("policy"),
                self.policy,
            )
            return
        self.interval = int(state["interval"])
        self.stale_uses = int(state["stale_uses"])
        self.counts.update(state.get("counts", {}))
        self.last_drift = state.get("last_drift")
        self.drifts = [float(d) for d in state.get("drifts", ())]

    def __repr__(self) -> str:
        return (
            f"RefreshPolicy({self.policy!r}, interval={self.interval}, drift_threshold={self.drift_threshold}, "
            f"probe_period={self.probe_period}, max_interval={self.max_interval})"
        )
