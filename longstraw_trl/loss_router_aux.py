"""The MoE router load-balancing loss inside a micro-batch's streamed loss (:class:`RouterAuxShares`): the whole
micro-batch's router statistics first (graph-free), then each response's differentiable share with its replay (one
position longer), and with the full gradient each prompt's share with its prompt backward
(:mod:`longstraw_trl.router_aux` holds the math)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .loss import LossNormalizer
from .loss_prompts import GroupPrompts
from .loss_rows import MicroBatchRows
from .prompt_state_manager import StepHost
from .router_aux import MicroBatchRouterAux, RouterLoadBalancing, prepare_micro_batch, replay_inputs
from .state_grads import StateGrads

__all__ = ["RouterAuxShares"]


class RouterAuxShares:
    """TRL's ``router_aux_loss_coef * aux_loss / ga`` of one micro-batch, as shares: the captured prompt tokens'
    (a constant), each response's (with its replay) and, with the full gradient, each prompt's (with its prompt
    backward).

    Build it with :meth:`prepare`, which needs every group's prompt state: the statistics span the micro-batch.

    Args:
        aux: the micro-batch's router statistics.
        lb: the model's routers.
        coef: the loss's coefficient (``router_aux_loss_coef``).
        ctx: the micro-batch's normalisers (the shares are divided by ``ga``).
    """

    def __init__(self, aux: MicroBatchRouterAux, lb: RouterLoadBalancing, coef: float, ctx: LossNormalizer):
        self.aux, self.lb, self.coef, self.ctx = aux, lb, coef, ctx

    @classmethod
    def prepare(
        cls,
        lb: RouterLoadBalancing,
        model: nn.Module,
        host: StepHost,
        prompts: GroupPrompts,
        rows: MicroBatchRows,
        inputs: dict[str, Any],
        group_order: list[int],
        coef: float,
        ctx: LossNormalizer,
        max_tokens: int | None,
    ) -> RouterAuxShares:
        """Every group's prompt state acquired (in ``group_order``), then the micro-batch's router statistics
        (graph-free: the captured prompts' and one forward of every response)."""
        for g in group_order:
            prompts.entry(g)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        groups = []
        for g, entry in prompts.acquired():
            stats = prompts.prompt_states.router_prompt_stats(entry)
            group_rows = rows.rows_of[g]
            groups.append((entry.state, stats, completion_ids[group_rows], completion_mask[group_rows]))
        with host.graph_free(model):
            aux = prepare_micro_batch(lb, model, groups, max_tokens)
        return cls(aux, lb, coef, ctx)

    def prompt_constant(self) -> torch.Tensor:
        """The weighted share no response carries: the captured prompt tokens' (no gradient)."""
        return self.coef * self.aux.constant() / self.ctx.ga_normalizer

    def weighted(self, response_share: torch.Tensor) -> torch.Tensor:
        """A response's share (:meth:`replay`), weighted as it enters the loss."""
        return self.coef * response_share / self.ctx.ga_normalizer

    def replay(
        self,
        policy_replay: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        model: nn.Module,
        state: Any,
        ids: torch.Tensor,
        mask: torch.Tensor,
        length: int,
        entropy_grad: bool = False,
        grads: StateGrads | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A response (``ids``, ``mask``: its ``[R]`` row) replayed one position longer (``[last prompt token,
        completion]``: TRL routes every completion token under its mask) by ``policy_replay``: its ``length``
        log-probs and entropies (at least one: a row without completion tokens still routes its prompt), its
        differentiable share of the load-balancing loss, and the length its loss term takes."""
        ext_ids, router_mask, keep = replay_inputs(ids, mask, length)
        with self.lb.stash() as router_logits:
            logps, entropies = policy_replay(
                model,
                state,
                ext_ids[None],
                torch.ones_like(ext_ids)[None],
                entropy_grad=entropy_grad,
                grads=grads,
            )
        return logps[0, :keep], entropies[0, :keep], self.aux.term(router_logits, router_mask), max(length, 1)

    def prompt_segment_loss(self, num_rows: int) -> Callable[[], contextlib.AbstractContextManager]:
        """With the full gradient, the prompt tokens' share of a group of ``num_rows`` rows, for each chunk its
        prompt backward recomputes (``prompt_backward``'s ``segment_loss``)."""
        weight = num_rows * self.coef / self.ctx.ga_normalizer
        return functools.partial(self.aux.prompt_segment, weight)

    def report(
        self, sink: dict[str, list], gather_for_metrics: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """TRL's ``aux_loss`` metric: ``gather_for_metrics(aux_loss).mean()``, before the coefficient."""
        sink["aux_loss"].append(gather_for_metrics(self.aux.value()).mean().item())
