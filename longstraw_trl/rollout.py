"""The GRPO step's rollouts: each group's completions sampled from its prompt state, and the tool turns of TRL's tool
loop, each continuing its rollout's own (extended) state. No TRL here: the trainer hands its generation calls over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from .fsdp import fsdp2_units_kept_gathered
from .generation import SamplingParams, generate_from_state
from .positions import PositionLimit, check_prompt_lengths
from .prompt_state import PromptState
from .prompt_state_manager import PromptStateManager, StepHost
from .state_cache import prompt_key

__all__ = ["Rollout", "padded_prompt_length", "truncate_after_eos"]

logger = logging.getLogger(__name__)


def truncate_after_eos(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """TRL's post-processing: keep each row up to and including its first EOS."""
    device = completion_ids.device
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    positions = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
    keep = positions <= eos_idx.unsqueeze(1)
    return [row[m].tolist() for row, m in zip(completion_ids.cpu(), keep.cpu(), strict=True)]


def padded_prompt_length(lengths: Iterable[int], pad_to_multiple_of: int | None) -> int:
    """The row length TRL left-pads one generation call's prompts to (what ``generate``'s min_length counts)."""
    length = max(lengths)
    multiple = pad_to_multiple_of
    return -(-length // multiple) * multiple if multiple else length


class Rollout:
    """Sampling completions from prompt states with a trainer's settings.

    Args:
        host: the phase, metrics and graph-free context.
        prompt_states: where each prompt's state comes from.
        sampling: the sampler's settings (:class:`~longstraw_trl.generation.SamplingParams`).
        eos_token_ids: the ids after which a completion is cut (TRL's ``eos_token_ids``).
        pad_to_multiple_of: TRL's left padding of a generation call's prompts.
        temperature: TRL's sampling temperature.
        fsdp_gather_bytes: under FSDP2, the memory a generation may spend keeping units gathered across decode steps
            (:func:`~longstraw_trl.fsdp.fsdp2_units_kept_gathered`; ``None``: what the GPU can still give).
        position_limit: the model's positions: a prompt (or an agent turn's extended prompt) plus the completion
            that cannot fit is refused before it is captured (``None``: left to the engine).
    """

    def __init__(
        self,
        host: StepHost,
        prompt_states: PromptStateManager,
        sampling: SamplingParams,
        eos_token_ids: list[int],
        pad_to_multiple_of: int | None = None,
        temperature: float = 1.0,
        fsdp_gather_bytes: int | None = None,
        position_limit: PositionLimit | None = None,
    ):
        self.host, self.prompt_states, self.sampling = host, prompt_states, sampling
        self.fsdp_gather_bytes = fsdp_gather_bytes
        self.eos_token_ids, self.pad_to_multiple_of = eos_token_ids, pad_to_multiple_of
        self.temperature = temperature
        self.position_limit = position_limit

    def check_positions(self, prompt_lengths: list[int], where: str) -> None:
        """Refuse, before any capture, prompts that with ``max_completion_length`` (the sampler's
        ``max_new_tokens``) exceed the model's positions, naming their rows."""
        if self.position_limit is not None:
            rows = list(enumerate(prompt_lengths))
            check_prompt_lengths(rows, self.sampling.max_new_tokens, self.position_limit, where)

    def sample_group(
        self, state: PromptState, num_generations: int, prompt_ids=None, input_length: int | None = None
    ) -> torch.Tensor:
        """``[G, R]`` completions sampled from one prompt state (rows padded after their EOS). ``prompt_ids`` and
        ``input_length`` (TRL's left-padded row length) are what ``model.generate`` would see of the prompt."""
        kwargs = self.sampling.sampler_kwargs()
        if prompt_ids is not None:
            kwargs["prompt_ids"] = torch.as_tensor(prompt_ids, dtype=torch.long)
        model = self.prompt_states.model
        with (
            self.host.graph_free(model, cast_adapters=True),
            fsdp2_units_kept_gathered(model, self.fsdp_gather_bytes) as still_gathering,
        ):
            # FSDP2 units gathered and freed around every forward: no CUDA graph of the step
            if still_gathering:
                kwargs["cuda_graphs"] = False
            return generate_from_state(
                state,
                model,
                num_generations,
                self.sampling.max_new_tokens,
                input_length=input_length,
                **kwargs,
            )

    def generate_groups(self, prompt_ids: list, num_generations: int) -> list[list[int]]:
        """One generation call of TRL: ``num_generations`` completions per group of rows, sampled from each group's
        prompt state (acquired once; an ``adaptive`` probe measured on the first completion)."""
        keys, entries = self.prompt_states.acquire_groups(prompt_ids, num_generations)
        completion_ids: list[list[int]] = []
        seconds, new_tokens = 0.0, 0
        input_length = padded_prompt_length(
            (entries[key].prompt_ids.numel() for key in keys), self.pad_to_multiple_of
        )
        for key in keys:
            entry = entries[key]
            start = time.perf_counter()
            sampled = self.sample_group(entry.state, num_generations, entry.prompt_ids, input_length)
            seconds += time.perf_counter() - start
            rows = truncate_after_eos(sampled, self.eos_token_ids)
            new_tokens += sum(len(r) for r in rows)
            self._finish_probe(entry, rows[0])
            completion_ids.extend(rows)
        metrics = self.host.phase_metrics()
        metrics["longstraw/generation_seconds"].append(seconds)
        metrics["longstraw/generation_tokens_per_second"].append(new_tokens / max(seconds, 1e-9))
        metrics["longstraw/live_state_bytes"].append(float(self.prompt_states.nbytes()))
        return completion_ids

    def adopt_groups(self, prompt_ids: list, num_generations: int, completion_ids: list[list[int]]) -> None:
        """Completions of one generation call drawn elsewhere (an injected ``model.generate``, see
        ``LongStrawGRPOTrainer._generate_single_turn``): each group's prompt state is acquired all the same (the old /
        reference log-probs and the loss replay on it) and its ``adaptive`` probe measured on its first completion."""
        keys, entries = self.prompt_states.acquire_groups(prompt_ids, num_generations)
        for key, first in zip(keys, completion_ids[::num_generations], strict=True):
            self._finish_probe(entries[key], first)

    def _finish_probe(self, entry, completion: list[int]) -> None:
        if entry.probe_stale is not None:
            probe = torch.tensor(completion, dtype=torch.long)
            self.prompt_states.finish_probe(entry, probe, torch.ones_like(probe), self.temperature)

    def tool_turn(self, prompt_ids: list) -> list[list[int]]:
        """One continuation per row of TRL's tool loop, each from its own state: the longest cached prefix of the row
        (its group's prompt, or its previous tool turn) extended by the tokens after it (``PromptStateCache.get``)."""
        states = self.prompt_states
        rows: list[list[int]] = []
        seconds, new_tokens = 0.0, 0
        input_length = padded_prompt_length((len(ids) for ids in prompt_ids), self.pad_to_multiple_of)
        # each rollout's turn extends its state by the tool's tokens, then samples from it: checked before both
        self.check_positions(
            [len(ids) for ids in prompt_ids], f"a tool turn's rollouts (global step {self.host.global_step})"
        )
        for ids in prompt_ids:
            key = prompt_key(ids)
            entry = states.acquire(key, ids, purpose="tool turn")
            states.tool_turn_keys.add(key)
            if entry.parent is None and key not in (states.batch_groups or ()):
                # only possible if the group's state was gone (it is held until the loss); correct, but costly
                logger.warning(
                    "LongStraw tool turn: no cached prefix of a %d-token rollout: captured from its first token",
                    len(ids),
                )
            start = time.perf_counter()
            sampled = self.sample_group(entry.state, 1, entry.prompt_ids, input_length)
            seconds += time.perf_counter() - start
            row = truncate_after_eos(sampled, self.eos_token_ids)
            new_tokens += sum(len(r) for r in row)
            rows.extend(row)
        metrics = self.host.phase_metrics()
        metrics["longstraw/tool_turn_seconds"].append(seconds)
        metrics["longstraw/tool_turn_tokens_per_second"].append(new_tokens / max(seconds, 1e-9))
        return rows
