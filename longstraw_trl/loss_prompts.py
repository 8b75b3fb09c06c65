"""The prompt side of a micro-batch's loss: each group's prompt state, acquired once (:class:`GroupPrompts`), and,
with the full gradient, each group's prompt backward and the state gradient that feeds it
(:class:`FullGradientPrompts`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from .errors import LongStrawError
from .loss_rows import MicroBatchRows
from .loss_sync import GradientSync
from .prompt_state_manager import PromptStateManager, StepHost, peak_memory_gib
from .state_cache import CachedPrompt
from .state_grads import StateGrads

__all__ = ["FullGradientPrompts", "GroupPrompts"]


class GroupPrompts:
    """Each group's prompt state for a micro-batch's loss, acquired (refresh policy, adaptive probe) the first time it
    is asked for and kept for the rest of the micro-batch; :meth:`acquired` lists them in that order.

    Args:
        prompt_states: the step's prompt states.
        inputs: the micro-batch (``longstraw_prompts``: each group's key and prompt ids; ``completion_ids``).
        rows: its rows.
        temperature: the sampling temperature (an adaptive refresh probe's replay).
    """

    def __init__(
        self,
        prompt_states: PromptStateManager,
        inputs: dict[str, Any],
        rows: MicroBatchRows,
        temperature: float,
    ):
        self.prompt_states, self.inputs, self.rows, self.temperature = (
            prompt_states,
            inputs,
            rows,
            temperature,
        )
        self._entries: dict[int, CachedPrompt] = {}

    def entry(self, g: int) -> CachedPrompt:
        """Group ``g``'s prompt state (acquired on first use; an adaptive refresh probe replays its first row with
        loss tokens)."""
        if g not in self._entries:
            key, prompt_ids = self.inputs["longstraw_prompts"][g]
            entry = self.prompt_states.acquire(key, prompt_ids, purpose="loss")
            if entry.probe_stale is not None:
                self._finish_probe(entry, self.rows.rows_of[g])
            self._entries[g] = entry
        return self._entries[g]

    def _finish_probe(self, entry: CachedPrompt, rows: list[int]) -> None:
        lengths, loss_mask = self.rows.lengths, self.rows.loss_mask
        probe = next((i for i in rows if lengths[i] > 0), None)
        if probe is None:
            entry.probe_stale = None
            return
        completion = self.inputs["completion_ids"][probe]
        self.prompt_states.finish_probe(entry, completion, loss_mask[probe], self.temperature)

    def acquired(self) -> Iterator[tuple[int, CachedPrompt]]:
        """``(group, entry)`` of every group acquired so far, in the order they were."""
        return iter(list(self._entries.items()))


class FullGradientPrompts:
    """The full gradient's prompt side: each group's state gradient (:meth:`state_grads`, which its replays fill),
    then its prompt backward (:meth:`backward`: the capture chunks recomputed under autograd, in reverse), the
    last group's synchronising the gradients under DDP.

    Args:
        host: the step's device and metrics.
        sync: the micro-batch's gradient synchronisation.
        segment_context: the context a recomputed segment runs under (autocast, the engine's checkpointing).
        checkpoint_layers: whether the prompt backward's chunks checkpoint their layers.
        prompt_backward: the engine's prompt backward (:func:`~longstraw_trl.engine.prompt_backward`).
    """

    def __init__(
        self,
        host: StepHost,
        sync: GradientSync,
        segment_context: Callable[[nn.Module], contextlib.AbstractContextManager],
        checkpoint_layers: bool | None,
        prompt_backward: Callable[..., None],
    ):
        self.host, self.sync, self.segment_context = host, sync, segment_context
        self.checkpoint_layers, self.prompt_backward = checkpoint_layers, prompt_backward

    @staticmethod
    def state_grads(entry: CachedPrompt) -> StateGrads:
        """The gradient buffers of group ``entry``'s prompt state, which its replays fill."""
        return StateGrads(entry.state)

    def backward(
        self,
        model: nn.Module,
        g: int,
        entry: CachedPrompt,
        grads: StateGrads,
        segment_loss: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        """Group ``g``'s prompt backward, carrying ``grads`` into its prompt tokens (``segment_loss``: a further
        loss of each recomputed chunk, the router loss's prompt share)."""
        metrics = self.host.phase_metrics()
        # the step's peak before this group's prompt backward (captures, generation and replays so far): the prompt
        # backward's own peak is the step's when the step's is higher
        peak = peak_memory_gib(self.host.device)
        if peak is not None:
            metrics["longstraw/peak_before_prompt_backward_gib"].append(peak)
        start = time.perf_counter()
        last = self.sync.prompt_backward_syncs(g)
        if last and entry.state.resident_tokens == 0:
            raise LongStrawError(
                "gradient_mode='full' under DDP needs the last prompt of a micro-batch to have more than one "
                "token (its prompt backward synchronises the gradients)."
            )
        with self.segment_context(model):
            self.prompt_backward(
                entry.state,
                model,
                grads,
                checkpoint_layers=self.checkpoint_layers,
                no_sync=self.sync.inside_prompt_backward(),
                sync_last=last,
                segment_loss=segment_loss,
            )
        metrics["longstraw/prompt_backward_seconds"].append(time.perf_counter() - start)
