"""``longstraw`` command line (also ``python -m longstraw_trl``): its commands and their dispatch.

This module imports the standard library only, so ``longstraw --help`` answers at once; a command's module, with the
planner and torch behind it, is imported when that command runs (as pip loads its commands).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import NamedTuple


class Command(NamedTuple):
    """A ``longstraw`` command: the module whose ``main(argv) -> int`` runs it, and one line of help."""

    module: str
    summary: str


COMMANDS = {
    "plan": Command(
        ".cli_plan",
        "a GRPO step's memory per rank: does it fit the GPU (and the host), do the model's positions reach, "
        "what to change",
    ),
}


def help_text() -> str:
    width = max(len(name) for name in COMMANDS)
    commands = "\n".join(f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items())
    return (
        "usage: longstraw <command> [options]\n\n"
        "LongStraw-TRL: GRPO on million-token prompts for Hugging Face TRL.\n\n"
        f"commands:\n{commands}\n\n"
        "`longstraw <command> --help` lists a command's options."
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); its exit status."""
    try:
        status = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # inside the try: a buffered stdout would otherwise fail at interpreter exit
        return status
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"longstraw: error: unknown command {argv[0]!r}; {hint}commands: {', '.join(COMMANDS)} "
            "(longstraw --help)",
            file=sys.stderr,
        )
        return 2
    return importlib.import_module(command.module, __package__).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
