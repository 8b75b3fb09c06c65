"""Agent training on prompt states: TRL's `tools`, `environment_factory` and `rollout_func` with `LongStrawGRPOTrainer`.

TRL (1.16) runs tools in `GRPOTrainer._tool_call_loop`: after the first generation it parses each completion's tool
calls, runs them (sync, or async on `trainer.async_loop`; a tool that raises gives `{"error": ...}`), builds
`prompt_ids + completion_ids + tool_suffix_ids` for every rollout that called a tool and generates again from that
sequence with `_generate_single_turn(..., num_generations=1)`, up to `max_tool_calling_iterations` times. The
completion that reaches the loss is the whole `completion + tool results + continuation`, with `tool_mask` 0 on the
tool-result tokens. All of that stays TRL's code; only the model work is routed to prompt states:

- **first turn**: the group's prompt is captured (or found in the prompt-state cache) once, and its `G` rollouts are
  sampled from it, as without tools;
- **tool turns** (:func:`generate_tool_turn`): TRL's one-row-per-rollout calls are recognised (the trainer's
  `_tool_call_loop` runs under :func:`tool_turns`), and each row's state is looked up in the prompt-state cache by
  longest cached prefix: the group's prompt (or the rollout's previous tool turn) is a prefix of
  `prompt + completion + tool suffix`, so the state is a fork of it *extended* by the new tokens only (copy-on-write
  K/V pages, a multi-token prefill), never captured from the first token. These rows are not loss groups: they are
  not recorded in `_batch_groups`, and their states are dropped from the cache when the tool loop ends;
- **loss**: each final completion (tool tokens included) is replayed on its group's prompt state, and the loss mask is
  `completion_mask * tool_mask`, exactly as TRL masks it (`LongStrawGRPOTrainer._streamed_loss`).

`environment_factory` needs nothing more (TRL builds one environment per rollout, calls `reset(**row)`, exposes its
public methods as tools and `get_reward()` as a reward function), except that the `G` rollouts of a row must share
their prompt (a `reset()` whose observation differs per rollout gives each its own prompt; the trainer refuses it).

`rollout_func(prompts, trainer)` (:func:`grouped_rollout_func`): completions made outside the trainer are scored and
trained by capture + replay: the returned `prompt_ids` are grouped (`G` consecutive rows per prompt, as TRL's sampler
yields them), each group's prompt is captured (or found) once, and TRL's code takes over: the returned `logprobs`
become `sampling_per_token_logps` and `env_mask` becomes `tool_mask`, as in TRL.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .state_cache import prompt_key

if TYPE_CHECKING:
    from .trainer import LongStrawGRPOTrainer

__all__ = ["generate_tool_turn", "grouped_rollout_func", "tool_turns"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def tool_turns(trainer: LongStrawGRPOTrainer) -> Iterator[None]:
    """While TRL's `_tool_call_loop` runs: its `_generate_single_turn` calls are tool turns (one row per rollout).

    The states the turns create are dropped from the prompt-state cache at the end: the loss replays every rollout on
    its group's prompt state, and a sampled history is not a prompt a later batch asks for."""
    cache = trainer.prompt_cache
    before = set(cache.entries)
    trainer._tool_turn_keys = set()
    try:
        yield
    finally:
        created, trainer._tool_turn_keys = trainer._tool_turn_keys - before, None
        cache.drop(created)


def generate_tool_turn(trainer: LongStrawGRPOTrainer, prompt_ids: list) -> tuple[list[list[int]], None]:
    """One continuation per row of TRL's tool loop, each from its own state: the longest cached prefix of the row
    (its group's prompt, or its previous tool turn) extended by the tokens after it (`PromptStateCache.get`)."""
    metrics = trainer._metrics[trainer._mode]
    rows: list[list[int]] = []
    seconds, new_tokens = 0.0, 0
    input_length = trainer._padded_prompt_length(len(ids) for ids in prompt_ids)
    for ids in prompt_ids:
        key = prompt_key(ids)
        entry = trainer._acquire(key, ids, purpose="tool turn")
        trainer._tool_turn_keys.add(key)
        if entry.parent is None and key not in trainer._batch_groups:
            # only possible if the group's state was gone (it is held until the loss); correct, but costly
            logger.warning(
                "LongStraw tool turn: no cached prefix of a %d-token rollout: captured from its first token",
                len(ids),
            )
        start = time.perf_counter()
        sampled = trainer._sample_group(entry.state, 1, entry.prompt_ids, input_length)
        seconds += time.perf_counter() - start
        row = trainer._truncate_after_eos(sampled)
        new_tokens += sum(len(r) for r in row)
        rows.extend(row)
    metrics["longstraw/tool_turn_seconds"].append(seconds)
    metrics["longstraw/tool_turn_tokens_per_second"].append(new_tokens / max(seconds, 1e-9))
    return rows, None


def grouped_rollout_func(rollout_func: Callable) -> Callable:
    """Wrap a TRL `rollout_func` so that each group of its returned `prompt_ids` gets its prompt state (captured or
    found in the cache) and is recorded for the old/reference log-probs and the loss, as a sampled group would be."""

    def rollout(prompts: list, trainer: LongStrawGRPOTrainer) -> dict[str, Any]:
        output = rollout_func(prompts, trainer)
        if isinstance(output, dict) and "prompt_ids" in output:  # TRL names missing keys itself afterwards
            num_generations = (
                trainer.num_generations if trainer._mode == "train" else trainer.num_generations_eval
            )
            trainer._acquire_groups(output["prompt_ids"], num_generations)
        return output

    rollout.__wrapped__ = rollout_func
    rollout.__name__ = getattr(rollout_func, "__name__", "rollout_func")
    return rollout
