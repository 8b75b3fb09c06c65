"""Errors raised on bad input, with messages that say what to change."""


class LongStrawError(ValueError):
    """Base class of LongStraw-TRL's input errors."""


class UnsupportedModelError(LongStrawError):
    """The model's architecture (or one of its options) has no LongStraw patch."""


class PromptTooLongError(LongStrawError):
    """The prompt (plus completion) exceeds the model's position limit."""


class PreflightError(LongStrawError):
    """The trainer's pre-flight plan found no setting under which the step fits: raised before the step's first
    capture, with the planner's table and the changes that would fit (``longstraw_trl.preflight``)."""


class LongStrawTrainingError(RuntimeError):
    """Training cannot continue (a reward function failed, a loss is not finite)."""


class RewardFunctionError(LongStrawTrainingError):
    """A reward function raised, or returned something other than one finite float (or None) per completion; the
    message names it (and the row, for a bad value)."""


class NonFiniteLossError(LongStrawTrainingError):
    """A response's loss term is NaN or infinite; training stops before it is back-propagated."""
