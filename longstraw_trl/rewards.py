"""Reward functions as TRL calls them, wrapped so that an exception or an output TRL cannot use says which function
it came from (`named_reward_function`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from trl.trainer.utils import is_async_callable

from .errors import RewardFunctionError

__all__ = ["check_reward_output", "named_reward_function", "short_repr"]


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def check_reward_output(name: str, output: Any, kwargs: dict) -> None:
    """What TRL needs from a reward function: one float (or None: not scored) per completion, finite. Raises
    :class:`RewardFunctionError` naming the function, what it returned and, for a bad value, the row."""
    completions = kwargs.get("completions")
    expected = "one float or None per completion"
    if completions is not None:
        expected += f" (a list of {len(completions)})"
    if isinstance(output, torch.Tensor | np.ndarray) and output.ndim == 1:
        values = output.tolist()
    elif isinstance(output, list | tuple):
        values = output
    else:
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(output).__name__} {short_repr(output)}; expected {expected}."
        )
    if completions is not None and len(values) != len(completions):
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {len(completions)} completions; expected "
            f"{expected}."
        )
    for row, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"reward function {name!r} returned {type(value).__name__} {short_repr(value)} for row {row}; expected "
                f"{expected}."
            )
        if not math.isfinite(value):
            where = f"row {row}"
            if completions is not None:
                where += f" (completion {short_repr(completions[row])})"
            raise RewardFunctionError(
                f"reward function {name!r} returned {value} for {where}: rewards must be finite (with an infinite "
                "reward stock TRL trains on with a zero loss and gradient). Return None for a completion the function "
                "does not score (TRL reads NaN as None; here it is refused, since it is more often a bug)."
            )


def named_reward_function(func: Callable, name: str) -> Callable:
    """Wrap a reward function so that an exception, or an output TRL cannot use (`check_reward_output`), says
    which function it came from."""

    def fail(exc: Exception):
        return RewardFunctionError(
            f"reward function {name!r} raised {type(exc).__name__}: {exc}. Fix the function (it receives "
            "prompts=, completions=, completion_ids= and every dataset column as keyword arguments, and must return "
            "one float or None per completion)."
        )

    if is_async_callable(func):

        async def wrapped(*args, **kwargs):
            try:
                output = await func(*args, **kwargs)
            except RewardFunctionError:
                raise
            except Exception as exc:
                raise fail(exc) from exc
            check_reward_output(name, output, kwargs)
            return output

    else:

        def wrapped(*args, **kwargs):
            try:
                output = func(*args, **kwargs)
            except RewardFunctionError:
                raise
            except Exception as exc:
                raise fail(exc) from exc
            check_reward_output(name, output, kwargs)
            return output

    wrapped.__name__ = getattr(func, "__name__", name)
    wrapped.__qualname__ = getattr(func, "__qualname__", name)
    wrapped.__wrapped__ = func
    return wrapped
