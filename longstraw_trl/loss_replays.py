"""A group's responses replayed under autograd on its prompt state, their terms back-propagated: together, one
backward a batch of rows (:class:`BatchedReplay`), or one response at a time in reverse blocks
(:class:`BlockReplay`). Both run one batch of :func:`~longstraw_trl.loss_rows.plan_group_replays` per call, add its
terms to the micro-batch's :class:`~longstraw_trl.loss_terms.LossTally` and time it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .engine import replay_blocks_backward
from .loss_router_aux import RouterAuxShares
from .loss_sync import GradientSync
from .loss_terms import LossTally, ResponseTerms
from .state_cache import CachedPrompt
from .state_grads import StateGrads

__all__ = ["BatchedReplay", "BlockReplay"]

PolicyReplay = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``policy_replay(model, state, ids [k, L], mask [k, L], entropy_grad=, grads=) -> (logps [k, L], entropies [k, L])``
(``StreamedLoss.policy_replay``)."""


class BatchedReplay:
    """A batch of a group's rows replayed together (``policy_replay``), each row's term from its slice of the
    batch's log-probs and entropies, and one backward of their sum. With the router loss, a batch is one row,
    replayed one position longer, its term carrying its router share.

    Args:
        policy_replay: the replay of ``k`` responses of one prompt state.
        inputs: the micro-batch (``completion_ids``, ``completion_mask``).
        terms: each response's term.
        tally: the micro-batch's sums.
        sync: the context each batch's backward runs under.
        backward: back-propagates a batch's terms (``None``: evaluation, no backward).
        entropy_grad: the entropies carry a graph (an entropy bonus).
        router_aux: the router loss's shares (``None``: off).
    """

    def __init__(
        self,
        policy_replay: PolicyReplay,
        inputs: dict[str, Any],
        terms: ResponseTerms,
        tally: LossTally,
        sync: GradientSync,
        backward: Callable[[torch.Tensor], None] | None,
        entropy_grad: bool,
        router_aux: RouterAuxShares | None = None,
    ):
        self.policy_replay, self.terms, self.tally, self.sync = policy_replay, terms, tally, sync
        self.completion_ids, self.completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        self.backward, self.entropy_grad, self.router_aux = backward, entropy_grad, router_aux

    def run(
        self,
        model: nn.Module,
        entry: CachedPrompt,
        g: int,
        batch: list[int],
        lengths: list[int],
        grads: StateGrads | None,
    ) -> None:
        """Rows ``batch`` of group ``g`` (prompt ``entry``), replayed ``lengths`` positions each; with the full
        gradient their state gradient goes to ``grads``."""
        start = time.perf_counter()
        with self.sync.around_batch(batch):
            batch_term = None
            for i, length, logps, entropies, router_share in self._replays(
                model, entry, batch, lengths, grads
            ):
                term, metrics = self.terms.term(i, g, entry, length, logps, entropies)
                if router_share is not None:
                    term = term + self.router_aux.weighted(router_share)
                batch_term = term if batch_term is None else batch_term + term
                self.tally.add(term, metrics, length)
            if self.backward is not None:
                self.backward(batch_term)
        self.tally.replay_seconds += time.perf_counter() - start

    def _replays(
        self,
        model: nn.Module,
        entry: CachedPrompt,
        batch: list[int],
        lengths: list[int],
        grads: StateGrads | None,
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per row: ``(row, loss length, logps, entropies, router share or None)``."""
        ids, mask = self.completion_ids, self.completion_mask
        if self.router_aux is not None:
            for i, length in zip(batch, lengths, strict=True):
                logps, entropies, share, length = self.router_aux.replay(
                    self.policy_replay, model, entry.state, ids[i], mask[i], length, self.entropy_grad, grads
                )
                yield i, length, logps, entropies, share
            return
        longest = max(lengths)
        logps, entropies = self.policy_replay(
            model,
            entry.state,
            ids[batch, :longest],
            mask[batch, :longest],
            entropy_grad=self.entropy_grad,
            grads=grads,
        )
        for j, (i, length) in enumerate(zip(batch, lengths, strict=True)):
            yield i, length, logps[j, :length], entropies[j, :length], None


class BlockReplay:
    """Reverse block replay: one response a batch, its blocks of ``block_size`` positions run forward, then
    back-propagated last block first (:func:`~longstraw_trl.engine.replay_blocks_backward`), peak memory one block's
    graph whatever the response's length.

    Args:
        block_size: positions per block.
        temperature: the sampling temperature.
        checkpoint_layers: whether the blocks checkpoint their layers.
        segment_context: the context a recomputed segment runs under (autocast, the engine's checkpointing).
        inputs: the micro-batch (``completion_ids``).
        terms: each response's term.
        tally: the micro-batch's sums.
        sync: the context each response's backwards run under.
        entropy_grad: the entropies carry a graph (an entropy bonus).
    """

    def __init__(
        self,
        block_size: int,
        temperature: float,
        checkpoint_layers: bool | None,
        segment_context: Callable[[nn.Module], contextlib.AbstractContextManager],
        inputs: dict[str, Any],
        terms: ResponseTerms,
        tally: LossTally,
        sync: GradientSync,
        entropy_grad: bool,
    ):
        self.block_size, self.temperature, self.checkpoint_layers = block_size, temperature, checkpoint_layers
        self.segment_context, self.completion_ids = segment_context, inputs["completion_ids"]
        self.terms, self.tally, self.sync, self.entropy_grad = terms, tally, sync, entropy_grad

    def run(
        self,
        model: nn.Module,
        entry: CachedPrompt,
        g: int,
        batch: list[int],
        lengths: list[int],
        grads: StateGrads | None,
    ) -> None:
        """Row ``batch[0]`` of group ``g`` (prompt ``entry``), ``lengths[0]`` positions; with the full gradient its
        state gradient goes to ``grads``."""
        (i,), (length,) = batch, lengths
        start = time.perf_counter()
        with self.sync.around_batch(batch):
            term, metrics = self._term(model, entry, g, i, length, grads)
            self.tally.replay_seconds += time.perf_counter() - start
            self.tally.add(term, metrics, length)

    def _term(
        self, model: nn.Module, entry: CachedPrompt, g: int, i: int, length: int, grads: StateGrads | None
    ) -> tuple[torch.Tensor, Any]:
        """Response ``i``'s term (detached: back-propagated block by block) and its metrics."""
        kept = {}

        def loss_term(logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
            term, metrics = self.terms.term(i, g, entry, length, logps, entropies)
            kept.setdefault("metrics", metrics)  # the first block's: every block sees the same values
            return term

        with self.segment_context(model):
            _, _, term = replay_blocks_backward(
                entry.state,
                model,
                self.completion_ids[i : i + 1, :length],
                self.block_size,
                loss_term,
                self.temperature,
                grads=grads,
                return_entropy=True,
                entropy_grad=self.entropy_grad,
                checkpoint_layers=self.checkpoint_layers,
                no_sync=self.sync.inside_response(i),
            )
        return term, kept["metrics"]
