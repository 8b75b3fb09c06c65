"""What the examples share: the CPU thread count, one progress bar over optimizer steps, and a run's summary.

Importing this module is cheap (the standard library only): an example parses its options with it before torch and
transformers load, so ``--help`` answers at once. The helpers that need torch or transformers import them when called.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics


# ----------------------------------------------------------------------------------------------------------------------
# Threads
# ----------------------------------------------------------------------------------------------------------------------
def default_threads(cores: int | None = None) -> int:
    """``--threads``' default: 1 on a machine of ``cores`` <= 2 (default: this machine's), else 0 (torch's default).

    On a 2-core machine a second intra-op thread made the first GRPO steps of the examples 7-10x slower than one
    (thread wake-ups on tiny matrix products; other processes share the cores)."""
    cores = os.cpu_count() if cores is None else cores
    return 1 if (cores or 1) <= 2 else 0


def add_threads_option(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="CPU threads (0: torch's default); the default is 1 on a machine of two cores or fewer, 0 otherwise",
    )


def use_threads(threads: int) -> int:
    """Set torch's intra-op threads to ``threads`` (0: leave torch's default); returns the count in use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------------------------------
def quiet_logs(trainer) -> None:
    """Remove transformers' progress bar and printed logs (the log history still records every step)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)


def show_step_progress(trainer) -> None:
    """One progress bar over optimizer steps (the latest reward and loss beside it) instead of transformers' bar and
    printed logs; under a multi-process launch only the first process draws it."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class StepProgress(TrainerCallback):
        def __init__(self):
            self.bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(
                total=state.max_steps,
                desc="GRPO",
                unit="step",
                dynamic_ncols=True,
                disable=not state.is_world_process_zero,
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs and "reward" in logs:
                self.bar.set_postfix(
                    reward=f"{logs['reward']:.2f}", loss=f"{logs.get('loss', float('nan')):.3f}"
                )

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    quiet_logs(trainer)
    trainer.add_callback(StepProgress())


# ----------------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------------
def step_logs(trainer) -> list[dict]:
    """The trainer's logged optimizer steps (those with a reward)."""
    return [h for h in trainer.state.log_history if "reward" in h]


def mean_of(key: str, rows: list[dict]) -> float:
    """Mean of ``key`` over the rows that log it (NaN if none does)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def reward_window(logs: list[dict], most: int) -> int:
    """Steps averaged for the first and last rewards of a summary: a quarter of the run, 1 to ``most``."""
    return max(1, min(most, len(logs) // 4))


def state_bytes_per_prompt(logs: list[dict]) -> dict[str, float]:
    """The prompt state's bytes by kind (``kv``, ``gdn``, ...) at the last logged step."""
    prefix = "longstraw/state_bytes/"
    return {k[len(prefix) :]: v for k, v in logs[-1].items() if k.startswith(prefix)} if logs else {}


def peak_memory_gib(logs: list[dict]) -> float:
    return max(((h.get("longstraw/peak_memory_gib") or 0.0) for h in logs), default=0.0)


def paired_gain(after: list[float], before: list[float]) -> tuple[float, float]:
    """Mean of ``after - before`` over the same questions, and its standard error."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), se


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def save_run(trainer, output_dir: str, summary: dict) -> None:
    """``log_history.json`` (every logged step) and ``summary.json`` in ``output_dir``."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f, indent=1)
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
