"""TRL's ``top_entropy_quantile`` token mask of a micro-batch, from a graph-free entropy pass over its responses.

TRL takes the quantile over the entropies of the whole micro-batch (all processes) before any loss term; the streamed
loss replays one response (batch) at a time, so every response with loss tokens is first replayed without autograd
(one forward per group, its rows batched, on the state the loss then uses) and TRL's own ``get_high_entropy_mask``
runs on those entropies. The mask is a comparison, so it needs no gradient. Its entropies match the loss replay's to
float rounding (~1e-6): a token's membership could differ from TRL's single-forward mask only if its entropy lies
that close to the threshold."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .engine import replay_logprobs
from .loss_prompts import GroupPrompts
from .loss_rows import MicroBatchRows
from .prompt_state_manager import StepHost

__all__ = ["replay_entropies", "top_entropy_mask"]


def replay_entropies(
    prompts: GroupPrompts, host: StepHost, inputs: dict[str, Any], rows: MicroBatchRows, temperature: float
) -> torch.Tensor:
    """``[B, R]`` float32 entropies of every response's positions up to its group's longest loss length (zero
    elsewhere), replayed graph-free on each group's prompt state, one forward per group."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    entropies = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    policy = prompts.prompt_states.model
    for g in range(rows.num_groups):
        group_rows = rows.rows_of[g]
        length = max(rows.lengths[i] for i in group_rows) if group_rows else 0
        if length == 0:
            continue
        entry = prompts.entry(g)
        with host.graph_free(policy):
            _, h = replay_logprobs(
                entry.state,
                policy,
                completion_ids[group_rows, :length],
                completion_mask[group_rows, :length],
                temperature,
                return_entropy=True,
            )
        entropies[group_rows, :length] = h.to(entropies.device)
    return entropies


def top_entropy_mask(
    prompts: GroupPrompts,
    host: StepHost,
    inputs: dict[str, Any],
    rows: MicroBatchRows,
    temperature: float,
    top_entropy_quantile: float,
    trl_mask: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
) -> torch.Tensor:
    """The micro-batch's high-entropy token mask: ``trl_mask`` (TRL's ``get_high_entropy_mask(entropies, mask,
    threshold)``) on the entropies of :func:`replay_entropies`, at threshold ``1 - top_entropy_quantile``; the pass's
    seconds go to ``longstraw/entropy_pass_seconds``."""
    start = time.perf_counter()
    entropies = replay_entropies(prompts, host, inputs, rows, temperature)
    host.phase_metrics()["longstraw/entropy_pass_seconds"].append(time.perf_counter() - start)
    return trl_mask(entropies, rows.loss_mask, 1 - top_entropy_quantile)
