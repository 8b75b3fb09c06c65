"""Agent training on prompt states: TRL's `tools`, `environment_factory` and `rollout_func` with `LongStrawGRPOTrainer`.

TRL (1.16) runs tools in `GRPOTrainer._tool_call_loop`: after the first generation it parses each completion's tool
calls, runs them (sync, or async on `trainer.async_loop`; a tool that raises gives `{"error": ...}`), builds
`prompt_ids + completion_ids + tool_suffix_ids` for every rollout that called a tool and generates again from that
sequence with `_generate_single_turn(..., num_generations=1)`, up to `max_tool_calling_iterations` times. The
completion that reaches the loss is the whole `completion + tool results + continuation`, with `tool_mask` 0 on the
tool-result tokens. All of that stays TRL's code; only the model work is routed to prompt states:

- **first turn**: the group's prompt is captured (or found in the prompt-state cache) once, and its `G` rollouts are
  sampled from it, as without tools;
- **tool turns** (:meth:`longstraw_trl.rollout.Rollout.tool_turn`): TRL's one-row-per-rollout calls are recognised
  (the trainer's `_tool_call_loop` runs under :meth:`longstraw_trl.prompt_state_manager.PromptStateManager.tool_turns`), and each
  row's state is looked up in the prompt-state cache by
  longest cached prefix: the group's prompt (or the rollout's previous tool turn) is a prefix of
  `prompt + completion + tool suffix`, so the state is a fork of it *extended* by the new tokens only (copy-on-write
  K/V pages, a multi-token prefill), never captured from the first token. These rows are not loss groups: they are
  not recorded in `PromptStateManager.batch_groups`, and their states are dropped from the cache when the tool loop ends;
- **loss**: each final completion (tool tokens included) is replayed on its group's prompt state, and the loss mask is
  `completion_mask * tool_mask`, exactly as TRL masks it (`longstraw_trl.streamed_loss`).

`environment_factory` needs nothing more (TRL builds one environment per rollout, calls `reset(**row)`, exposes its
public methods as tools and `get_reward()` as a reward function), except that the `G` rollouts of a row must share
their prompt (a `reset()` whose observation differs per rollout gives each its own prompt; the trainer refuses it).

Environment-owned data (TRL 1.16): with `environment_factory` the dataset needs no `prompt` column (TRL starts each
rollout from an empty user message and appends its `reset()` observation); a dict factory routes each row by its
`environment` column, and renders each prompt with that environment's tools only. A group is one prompt *and* one
environment (`LongStrawGRPOTrainer._tokenize_prompts`), so its `G` rollouts still share one prompt state.

A `generate` replaced on the model instance or on transformers' `GenerationMixin` (how TRL's own tests script
completions and tool calls) makes the trainer draw through stock's generation call instead of the prompt states;
each group's prompt state is still acquired for the log-probs and the loss (:meth:`Rollout.adopt_groups`), tool
turns then need no state of their own.

`rollout_func(prompts, trainer)` (:func:`grouped_rollout_func`): completions made outside the trainer are scored and
trained by capture + replay: the returned `prompt_ids` are grouped (`G` consecutive rows per prompt, as TRL's sampler
yields them), each group's prompt is captured (or found) once, and TRL's code takes over: the returned `logprobs`
become `sampling_per_token_logps` and `env_mask` becomes `tool_mask`, as in TRL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["grouped_rollout_func"]


def grouped_rollout_func(rollout_func: Callable) -> Callable:
    """Wrap a TRL `rollout_func` so that each group of its returned `prompt_ids` gets its prompt state (captured or
    found in the cache) and is recorded for the old/reference log-probs and the loss, as a sampled group would be.

    The wrapper reaches the trainer TRL passes it through its public surface only (`prompt_states`, `phase`,
    `num_generations`, `num_generations_eval`)."""

    def rollout(prompts: list, trainer) -> dict[str, Any]:
        output = rollout_func(prompts, trainer)
        if isinstance(output, dict) and "prompt_ids" in output:  # TRL names missing keys itself afterwards
            num_generations = (
                trainer.num_generations if trainer.phase == "train" else trainer.num_generations_eval
            )
            trainer.prompt_states.acquire_groups(output["prompt_ids"], num_generations)
        return output

    rollout.__wrapped__ = rollout_func
    rollout.__name__ = getattr(rollout_func, "__name__", "rollout_func")
    return rollout
