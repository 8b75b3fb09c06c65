"""What a LongStraw checkpoint adds to TRL's: the refresh policy's state and a record of the prompt states it
leaves out (`REFRESH_STATE_FILE`), written beside TRL's files and read back on resume."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["REFRESH_STATE_FILE", "load_refresh_record", "save_refresh_record", "warn_resume_inside_batch"]

logger = logging.getLogger(__name__)

REFRESH_STATE_FILE = "longstraw_refresh.json"


def save_refresh_record(folder: str, refresh_state: dict[str, Any], prompt_cache: dict[str, Any]) -> None:
    """Write the refresh policy's ``state_dict()`` and the prompt cache's summary into checkpoint ``folder``."""
    record = {**refresh_state, "prompt_cache": prompt_cache}
    with open(os.path.join(folder, REFRESH_STATE_FILE), "w") as f:
        json.dump(record, f)


def load_refresh_record(checkpoint: str) -> dict[str, Any] | None:
    """The record :func:`save_refresh_record` wrote into ``checkpoint`` (``None``: a checkpoint without one)."""
    path = os.path.join(checkpoint, REFRESH_STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def warn_resume_inside_batch(
    checkpoint: str,
    global_step: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    num_iterations: int,
) -> None:
    """Warn when ``checkpoint`` falls inside a generation batch: checkpoints hold neither TRL's buffered batch nor
    its micro-step counter, so the resumed run generates a new batch at once."""
    micro_steps = global_step * gradient_accumulation_steps
    generate_every = steps_per_generation * num_iterations
    if micro_steps % generate_every:
        logger.warning(
            "LongStraw resume from %s (step %d): the checkpoint falls inside a generation batch (one every %d "
            "micro-steps: steps_per_generation=%d x num_iterations=%d); checkpoints hold neither TRL's buffered "
            "batch nor its micro-step counter, so the resumed run generates a new batch at once where the "
            "uninterrupted one replays the buffered batch (TRL's behaviour). Choose save_steps so that "
            "save_steps x gradient_accumulation_steps is a multiple of %d for an exact resume.",
            checkpoint,
            global_step,
            generate_every,
            steps_per_generation,
            num_iterations,
            generate_every,
        )
