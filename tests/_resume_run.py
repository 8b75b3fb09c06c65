"""One small training run, shared by `tests/test_resume.py` and the process it SIGKILLs.

`python tests/_resume_run.py POLICY OUTPUT_DIR` trains it with `LONGSTRAW_TEST_KILL_AT=<step>` set: the reward
function (called while the step after `<step>` generates, i.e. mid-step) kills its own process with SIGKILL once
`checkpoint-<step>` has been written completely (the refresh record is its last file).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from _trl_helpers import make_tiny_longstraw_trainer
from datasets import Dataset

from longstraw_trl.trainer import REFRESH_STATE_FILE

KILL_ENV = "LONGSTRAW_TEST_KILL_AT"
PROMPT = "a long straw: 1234567890 " * 3  # one prompt: every step looks up the same state
MAX_STEPS, SAVE_STEPS = 5, 2
POLICIES = {
    # reuse: captured at step 0, reused at 1 and 2, re-captured at 3, reused at 4
    "recapture": dict(refresh_policy="recapture"),
    "reuse": dict(refresh_policy="reuse", refresh_interval=2),
    # adaptive: probes every 2nd stale use; the drift threshold is never reached, so each probe widens the interval
    "adaptive": dict(
        refresh_policy="adaptive",
        refresh_interval=1,
        refresh_probe_period=2,
        refresh_drift_threshold=10.0,
        refresh_max_interval=4,
    ),
}


def reward(completions, trainer_state=None, **kwargs):
    """Digits in the completion; with `LONGSTRAW_TEST_KILL_AT` set, SIGKILL once that step's checkpoint is done."""
    kill_at = os.environ.get(KILL_ENV)
    if kill_at is not None and trainer_state is not None and trainer_state.global_step == int(kill_at):
        checkpoint = os.path.join(os.environ["LONGSTRAW_TEST_OUTPUT_DIR"], f"checkpoint-{kill_at}")
        if os.path.exists(os.path.join(checkpoint, REFRESH_STATE_FILE)):
            os.kill(os.getpid(), signal.SIGKILL)
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def make_trainer(policy: str, output_dir: str, **kwargs):
    """The run's trainer: 4 rows of one prompt, one group a step, a checkpoint every `SAVE_STEPS` steps."""
    config = dict(
        output_dir=output_dir,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 4}),
        reward_funcs=reward,
        max_steps=MAX_STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        seed=0,
        **POLICIES[policy],
    )
    config.update(kwargs)
    return make_tiny_longstraw_trainer(**config)


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the tests run (tests/conftest.py): the same float results
    policy, output_dir = sys.argv[1], sys.argv[2]
    os.environ["LONGSTRAW_TEST_OUTPUT_DIR"] = output_dir
    make_trainer(policy, output_dir).train()
