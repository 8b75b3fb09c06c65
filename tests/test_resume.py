"""Checkpoints and resuming (docs/guide.md, "Checkpoints and resuming"): a run SIGKILLed mid-step after a checkpoint, then
resumed with `resume_from_checkpoint=True`, once per refresh policy.

Checkpoints hold the refresh policy's state (counters, interval, drift history) and a record of the prompt states
they leave out; a resume starts with an empty prompt cache. Under `recapture` that changes nothing (bit-identical to
the uninterrupted run); under `reuse` / `adaptive` the resumed run is, bit for bit, the uninterrupted run with its
prompt cache cleared after the checkpoint's step, and the warning says so.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _resume_run import KILL_ENV, MAX_STEPS, POLICIES, SAVE_STEPS, make_trainer
from transformers import TrainerCallback

from longstraw_trl.trainer import REFRESH_STATE_FILE

TESTS = Path(__file__).resolve().parent
KILL_AT = SAVE_STEPS  # killed while the step after the first checkpoint generates


class ClearPromptCacheAfter(TrainerCallback):
    """Drop the trainer's prompt states at the end of optimizer step `step` (what a resume from it does)."""

    def __init__(self, step: int):
        self.step, self.trainer = step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.trainer.free_prompt_states()


def _train(policy: str, output_dir: Path, clear_after: int | None = None):
    callback = ClearPromptCacheAfter(clear_after) if clear_after is not None else None
    trainer = make_trainer(policy, str(output_dir), callbacks=[callback] if callback else None)
    if callback:
        callback.trainer = trainer
    trainer.train()
    return trainer


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _step_logs(trainer) -> list[dict]:
    """Per step: the refresh actions and interval, the loss, the gradient norm and the reward (no timings)."""
    keep = ("loss", "grad_norm", "reward", "step")
    return [
        {k: v for k, v in h.items() if k in keep or k.startswith("longstraw/refresh/")}
        for h in trainer.state.log_history
        if "loss" in h
    ]


def _merge_captures(logs: list[dict]) -> list[dict]:
    """`capture` and `recapture` as one count (a prompt's first prefill in a fresh cache is a `capture`)."""
    out = []
    for h in logs:
        h = dict(h)
        h["captures"] = h.pop("longstraw/refresh/capture", 0) + h.pop("longstraw/refresh/recapture", 0)
        out.append(h)
    return out


def _same_weights(a, b) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_sigkill_mid_step_then_resume(policy, tmp_path, caplog):
    run = tmp_path / "killed"
    env = {**os.environ, KILL_ENV: str(KILL_AT), "PYTHONPATH": str(TESTS)}
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_resume_run.py"), policy, str(run)],
        env=env,
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [f"checkpoint-{KILL_AT}"]
    record = json.loads((run / f"checkpoint-{KILL_AT}" / REFRESH_STATE_FILE).read_text())
    cache = record["prompt_cache"]
    assert cache["saved"] is False and cache["states"] == 1 and cache["tokens"] > 0 and cache["bytes"] > 0

    caplog.set_level(logging.INFO, logger="longstraw_trl")
    resumed = make_trainer(policy, str(run))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == MAX_STEPS
    messages = [r.getMessage() for r in caplog.records if "LongStraw resume" in r.getMessage()]
    assert len(messages) == 1 and f"checkpoint-{KILL_AT} (step {KILL_AT})" in messages[0]

    plain = _train(policy, tmp_path / "plain")
    cleared = _train(policy, tmp_path / "cleared", clear_after=KILL_AT)
    # what the resume restored: the policy's counters, interval and drift history, as the run it stands for
    assert resumed.refresh_policy.state_dict() == cleared.refresh_policy.state_dict()
    assert _same_weights(_weights(resumed), _weights(cleared))
    assert _step_logs(resumed) == _step_logs(cleared)
    first_after = KILL_AT  # index of step KILL_AT + 1 in the logs
    if policy == "recapture":
        assert _same_weights(_weights(resumed), _weights(plain))
        # the same work; only the label of the step's first prefill differs: a first capture in the resumed cache
        assert _merge_captures(_step_logs(resumed)) == _merge_captures(_step_logs(plain))
        assert "equals the uninterrupted one" in messages[0]
    else:
        # the documented divergence: the state the uninterrupted run reused (or probed) stale is captured again
        assert f"cleared after step {KILL_AT}" in messages[0] and "1 state(s)" in messages[0]
        before = _step_logs(plain)[first_after]
        after = _step_logs(resumed)[first_after]
        assert before["longstraw/refresh/capture"] == 0 and after["longstraw/refresh/capture"] == 1
        assert before.get("longstraw/refresh/reuse", 0) + before.get("longstraw/refresh/probe", 0) >= 1
        assert _step_logs(resumed)[:first_after] == _step_logs(plain)[:first_after]
        assert not _same_weights(_weights(resumed), _weights(plain))
    if policy == "adaptive":
        assert (
            resumed.refresh_policy.drifts and resumed.refresh_policy.drifts == cleared.refresh_policy.drifts
        )


def test_resume_inside_a_generation_batch_is_named(tmp_path, caplog):
    """num_iterations=2: a checkpoint after step 1 falls inside a generation batch, which TRL does not checkpoint."""
    caplog.set_level(logging.WARNING, logger="longstraw_trl")
    first = make_trainer("recapture", str(tmp_path), num_iterations=2, max_steps=1, save_steps=1)
    first.train()
    resumed = make_trainer("recapture", str(tmp_path), num_iterations=2, max_steps=2, save_steps=1)
    resumed.train(resume_from_checkpoint=True)
    messages = [r.getMessage() for r in caplog.records if "inside a generation batch" in r.getMessage()]
    assert len(messages) == 1 and "checkpoint-1 (step 1)" in messages[0] and "multiple of 2" in messages[0]
