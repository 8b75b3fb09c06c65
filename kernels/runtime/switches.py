"""The kernel switches: environment variables that turn a fast path off, or an opt-in one on, for comparison
(README, "Kernel switches"). One reading for all of them: ``0``, ``false``, ``no`` or ``off`` (any case) turns a
default-on path off; ``1``, ``true``, ``yes`` or ``on`` turns a default-off path on; unset or anything else keeps
the default."""

from __future__ import annotations

import os
from collections.abc import Callable

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool = True) -> bool:
    """Whether the path behind environment variable ``name`` is on (``default`` when the variable says neither)."""
    value = os.environ.get(name, "").strip().lower()
    return value not in _OFF if default else value in _ON


def kernel_builds(make: Callable[[], object]) -> bool:
    """Whether ``make()`` (a kernel module's cached builder) succeeds: Triton importable and the kernel defined.
    A fast path's ``*_ok`` check ends with this; on ``False`` the caller takes its reference path."""
    try:
        make()
    except Exception:  # noqa: BLE001 - no triton (or it cannot build the kernel): the reference path serves
        return False
    return True
