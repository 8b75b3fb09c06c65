"""The kernel switches: environment variables that turn a fast path off, or an opt-in one on, for comparison
(README, "Kernel switches"). One reading for all of them: ``0``, ``false``, ``no`` or ``off`` (any case) turns a
default-on path off; ``1``, ``true``, ``yes`` or ``on`` turns a default-off path on; unset or anything else keeps
the default."""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool = True) -> bool:
    """Whether the path behind environment variable ``name`` is on (``default`` when the variable says neither)."""
    value = os.environ.get(name, "").strip().lower()
    return value not in _OFF if default else value in _ON
