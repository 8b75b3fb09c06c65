"""Prompt lengths against the model's positions, before anything is captured.

The trainer checks every prompt of its datasets at construction (tokenised as TRL tokenises them) plus
``max_completion_length``, and each generation call's prompts and each agent turn's extended prompt before their
capture (``longstraw_trl.rollout``). The limit is the planner's (:func:`~longstraw_trl.planner_positions.check_positions`):
``max_position_embeddings``, or the reach of a YaRN scaling where that is shorter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from .errors import PromptTooLongError
from .model_patches import unwrap_model
from .planner import check_positions

__all__ = ["PositionLimit", "check_prompt_lengths"]

# rows a refusal names before it counts the rest
NAMED_ROWS = 5


@dataclass(frozen=True)
class PositionLimit:
    """The most positions (prompt + completion) a model takes.

    Args:
        limit: the positions (``None``: nothing in the config bounds them).
        limited_by: what sets it: ``"max_position_embeddings"`` or ``"the YaRN scaling"``.
        max_position_embeddings: the config's.
    """

    limit: int | None
    limited_by: str | None = None
    max_position_embeddings: int | None = None

    @classmethod
    def of(cls, model_or_config) -> PositionLimit:
        """The limit of a model (any wrapper) or of its config."""
        config = model_or_config
        if isinstance(model_or_config, nn.Module):
            config = unwrap_model(model_or_config).config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        check = check_positions(config, 0, 0)
        return cls(check.limit, check.limited_by, check.max_position_embeddings)

    def fix(self, needed: int) -> str:
        """How to raise the limit to ``needed`` positions."""
        if self.limited_by == "the YaRN scaling":
            return (
                f"a larger YaRN factor in the model's config, reaching at least {needed:,} positions (with "
                "max_position_embeddings as large; a factor the model was not tuned with may cost quality)"
            )
        factor = math.ceil(needed / self.limit) if self.limit else 2
        return (
            f"a RoPE scaling in the model's config (e.g. rope_parameters {{'rope_type': 'yarn', 'factor': "
            f"{factor}.0, 'original_max_position_embeddings': {self.limit}}}) and max_position_embeddings >= "
            f"{needed:,} (a factor the model was not tuned with may cost quality)"
        )


def check_prompt_lengths(
    lengths: Iterable[tuple[int, int]], max_completion_length: int, limit: PositionLimit, where: str
) -> None:
    """Raise :class:`~longstraw_trl.errors.PromptTooLongError` naming every ``(row, prompt tokens)`` of ``lengths``
    whose prompt plus ``max_completion_length`` exceeds ``limit`` (the first rows and a count), and the fixes.

    ``where`` names the rows' origin (``"train_dataset"``, ``"this generation batch (global step 3)"``, ...).
    """
    if limit.limit is None:
        return
    most = limit.limit - max_completion_length
    too_long = [(row, n) for row, n in lengths if n > most]
    if not too_long:
        return
    named = ", ".join(f"row {row} ({n:,} tokens)" for row, n in too_long[:NAMED_ROWS])
    more = f" and {len(too_long) - NAMED_ROWS} more" if len(too_long) > NAMED_ROWS else ""
    longest = max(n for _, n in too_long)
    room = f"at most {most:,} prompt tokens" if most > 0 else "no prompt at all"
    raise PromptTooLongError(
        f"{where}: {len(too_long)} prompt(s) too long for the model: {named}{more}. A prompt plus "
        f"max_completion_length={max_completion_length} must fit the model's {limit.limit:,} positions "
        f"({limit.limited_by}), which leaves {room}. Drop or shorten those prompts, set a smaller "
        f"max_completion_length, or give the model more positions: {limit.fix(longest + max_completion_length)}."
    )
