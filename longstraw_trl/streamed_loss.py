"""The GRPO step's loss: TRL's `_compute_loss` value for one micro-batch, computed (and back-propagated) one response,
or one batch of a group's responses, at a time on the groups' prompt states.

:meth:`StreamedLoss.__call__` drives a micro-batch through parts that each own one concern:

1. **rows** (:class:`~longstraw_trl.loss_rows.MicroBatchRows`): each row's group, the rows of each group, each row's
   loss length; each group's prompt state acquired once (:class:`~longstraw_trl.loss_prompts.GroupPrompts`);
2. **entropy mask** (``top_entropy_quantile < 1``, :func:`~longstraw_trl.loss_entropy_mask.top_entropy_mask`): a
   graph-free replay of every response, TRL's quantile mask;
3. **scaling**: :func:`~longstraw_trl.loss.batch_loss_context` (TRL's normalisers for every loss type);
4. **sync** (:func:`~longstraw_trl.loss_sync.plan_sync`, :class:`~longstraw_trl.loss_sync.GradientSync`): under DDP,
   which backward synchronises the gradients (the longest response's, run last; or, with the full gradient, the last
   group's prompt backward) and which run under ``no_sync``;
5. **router loss** (:class:`~longstraw_trl.loss_router_aux.RouterAuxShares`): the whole micro-batch's router
   statistics, graph-free, before any term; then each response's share with its replay;
6. for each group (the sync plan's order): its rows planned (:func:`~longstraw_trl.loss_rows.plan_group_replays`:
   rows without loss tokens skipped, the rest cut into replay batches), each batch replayed under autograd
   (:class:`~longstraw_trl.loss_replays.BatchedReplay` over :meth:`StreamedLoss.policy_replay`, or
   :class:`~longstraw_trl.loss_replays.BlockReplay`), its terms (:class:`~longstraw_trl.loss_terms.ResponseTerms`)
   checked finite and back-propagated together; with the full gradient, the group's prompt backward
   (:class:`~longstraw_trl.loss_prompts.FullGradientPrompts`) after its replays;
7. **metrics** (:class:`~longstraw_trl.loss_terms.LossTally`): TRL's, aggregated over processes, and the replay's
   throughput.

No TRL trainer here: the host supplies the phase and metrics (:class:`~longstraw_trl.prompt_state_manager.StepHost`) and the
collectives (:class:`Collectives`: Accelerate's ``Accelerator`` is one; :class:`SingleProcess` for one process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .engine import checkpointing_off, prompt_backward, replay_logprobs
from .errors import NonFiniteLossError
from .fused_forwards import replay_forwards
from .loss import GRPOLossSpec, LossNormalizer, batch_loss_context, response_loss
from .loss_entropy_mask import top_entropy_mask
from .loss_prompts import FullGradientPrompts, GroupPrompts
from .loss_replays import BatchedReplay, BlockReplay
from .loss_router_aux import RouterAuxShares
from .loss_rows import MicroBatchRows, plan_group_replays, replay_batches, split_by_groups
from .loss_sync import GradientSync, SyncPlan, plan_sync
from .loss_terms import LossTally, ResponseTerms
from .options import LossOptions
from .prompt_state import PromptState
from .prompt_state_manager import PromptStateManager, StepHost
from .router_aux import RouterLoadBalancing
from .state_grads import StateGrads

__all__ = [
    "Collectives",
    "LossOptions",
    "LossScaling",
    "NonFiniteLossError",
    "SingleProcess",
    "StreamedLoss",
    "SyncPlan",
    "plan_sync",
    "replay_batches",
    "split_by_groups",
]

_NULL_CONTEXT = contextlib.nullcontext()


class Collectives(Protocol):
    """What the loss needs of the processes it runs on (Accelerate's ``Accelerator`` provides all of it)."""

    num_processes: int

    def backward(self, loss: torch.Tensor) -> None: ...

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager: ...

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor: ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor: ...


class SingleProcess:
    """:class:`Collectives` of one process: plain ``backward()``, every collective the identity."""

    num_processes = 1

    @staticmethod
    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    @staticmethod
    def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def autocast() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def reduce(tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1) if tensor.dim() == 0 else tensor

    gather_for_metrics = gather


@dataclass(frozen=True)
class LossScaling:
    """What the micro-batch's terms are scaled by (TRL's normalisers), set by the trainer for each call.

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step (1 in evaluation).
        training: train (``True``) or evaluation.
        entropy_coef: the entropy bonus's coefficient for this accumulation window.
        micro_step: the trainer's micro-step (error messages).
        global_step: the optimizer step (error messages).
    """

    gradient_accumulation_steps: int = 1
    training: bool = True
    entropy_coef: float = 0.0
    micro_step: int = 0
    global_step: int = 0


class StreamedLoss:
    """TRL's ``_compute_loss`` for one micro-batch, streamed over responses (module docstring: the path a micro-batch
    takes).

    Args:
        spec: the loss (:class:`~longstraw_trl.loss.GRPOLossSpec`).
        options: how responses are replayed (:class:`LossOptions`).
        host: phase and metrics.
        prompt_states: each group's prompt state.
        collectives: backward, ``no_sync``, autocast and reductions (:class:`Collectives`).
        router_aux: the MoE load-balancing loss (``None``: off).
        entropy_mask: TRL's ``get_high_entropy_mask(entropies, mask, threshold)`` (``top_entropy_quantile < 1``).
    """

    def __init__(
        self,
        spec: GRPOLossSpec,
        options: LossOptions,
        host: StepHost,
        prompt_states: PromptStateManager,
        collectives: Collectives,
        router_aux: RouterLoadBalancing | None = None,
        entropy_mask: Callable | None = None,
    ):
        self.spec, self.options, self.host = spec, options, host
        self.prompt_states, self.collectives = prompt_states, collectives
        self.router_aux, self.entropy_mask = router_aux, entropy_mask

    # --- replays ------------------------------------------------------------------------------------------------------
    def segment_context(self, model: nn.Module):
        """Around a call that recomputes segments under autograd (the full gradient, reverse block replay): the
        autocast, and the engine's own (non-reentrant) layer checkpointing in place of HF's, since a segment hands
        its layers' K/V and states out of the layer (a reentrant checkpoint would cut their graph)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.collectives.autocast())
        stack.enter_context(checkpointing_off(model))
        return stack

    def policy_replay(
        self,
        model: nn.Module,
        state: PromptState,
        ids: torch.Tensor,
        mask: torch.Tensor,
        entropy_grad: bool = False,
        grads: StateGrads | None = None,
    ):
        """``[k, L]`` log-probs (with autograd when enabled) and ``[k, L]`` entropies (with autograd only for
        ``entropy_grad``: an entropy bonus) of ``k`` responses of one prompt state, replayed together.

        ``model`` may be DDP-wrapped: the engine enters it through its root forward, so DDP prepares its gradient
        reduction as for any forward."""
        options = self.options
        context = self.segment_context(model) if grads is not None else self.collectives.autocast()
        checkpoint_layers = (
            options.segment_checkpoint_layers if grads is not None else options.replay_checkpoint_layers
        )
        with context:
            logps, entropy = replay_logprobs(
                state,
                model,
                ids,
                mask,
                options.temperature,
                grad=torch.is_grad_enabled(),
                checkpoint_layers=checkpoint_layers,
                return_entropy=True,
                entropy_grad=entropy_grad,
                grads=grads,
            )
        return logps, entropy.reshape(logps.shape)

    # --- the micro-batch ----------------------------------------------------------------------------------------------
    def __call__(
        self, model: nn.Module, inputs: dict[str, Any], backward: bool, scaling: LossScaling
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's loss (detached: back-propagated here when ``backward``) and, with an entropy bonus, the
        ``[entropy sum, token count]`` of the tokens it acts on (TRL's adaptive entropy controller)."""
        # One process has nothing to reduce, yet Accelerate wraps a one-process CPU (gloo) launch in DDP and makes its
        # `no_sync` a no-op there: every forward would then arm DDP's reducer, and a backward that enters through a
        # segment's K/V and states (the prompt backward) instead of that forward's outputs would fire the parameters'
        # hooks against it (marked ready twice, or never). DDP's own `no_sync` keeps the reducer out.
        lone_ddp = (
            isinstance(model, nn.parallel.DistributedDataParallel) and self.collectives.num_processes == 1
        )
        # HF's norm and MLP modules through the fused kernels with their own backward, and plain LoRA layers' update in
        # their base GEMM's epilogue, where configured: bound for the whole micro-batch, since a checkpointed replay or
        # segment recomputes its forwards in its backward, which must run the forwards its first pass ran
        fused = replay_forwards(model, self.options.autograd_fused_kernels, differentiable=True)
        with model.no_sync() if lone_ddp else _NULL_CONTEXT, fused:
            return self._micro_batch(model, inputs, backward, scaling)

    def _micro_batch(
        self, model: nn.Module, inputs: dict[str, Any], backward: bool, scaling: LossScaling
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = self._parts(model, inputs, backward, scaling)
        for g in parts.sync.plan.group_order:
            self._group(model, parts, g)
        sink = self.host.phase_metrics()
        parts.tally.report_loss_metrics(self.spec, self.collectives, sink)
        bonus_entropy = parts.tally.bonus_entropy(self.spec)
        if parts.router_aux is not None:
            parts.router_aux.report(sink, self.collectives.gather_for_metrics)
        parts.tally.report_replay_speed(sink)
        return parts.tally.total, bonus_entropy

    def _parts(
        self, model: nn.Module, inputs: dict[str, Any], backward: bool, scaling: LossScaling
    ) -> MicroBatchParts:
        """The micro-batch's parts, its entropy mask and router statistics computed (both before any term)."""
        spec, options = self.spec, self.options
        rows = MicroBatchRows.of(inputs)
        prompts = GroupPrompts(self.prompt_states, inputs, rows, options.temperature)
        ctx = self._loss_context(inputs, rows, prompts, scaling)
        ddp = backward and self.collectives.num_processes > 1
        full = backward and options.gradient_mode.full
        sync = GradientSync(
            plan_sync(rows.row_group, ctx.lengths, rows.num_groups, ddp, full), self.collectives, model
        )
        tally = LossTally(self.host.device)
        router_aux = None
        if self.router_aux is not None:  # every state first: the router statistics span the micro-batch
            router_aux = RouterAuxShares.prepare(
                self.router_aux,
                model,
                self.host,
                prompts,
                rows,
                inputs,
                sync.plan.group_order,
                spec.router_aux_loss_coef,
                ctx,
                options.capture_chunk_size,
            )
            tally.add_constant(router_aux.prompt_constant())
        # the entropies carry a graph only where the bonus contributes to the gradient
        entropy_grad = backward and spec.entropy_bonus_enabled and ctx.entropy_coef != 0.0
        terms = ResponseTerms(spec, ctx, inputs, scaling, response_loss)
        replay = self._replay(inputs, terms, tally, sync, backward, entropy_grad, router_aux)
        full_gradient = None
        if full:
            full_gradient = FullGradientPrompts(
                self.host,
                sync,
                self.segment_context,
                options.prompt_segment_checkpoint_layers,
                prompt_backward,
            )
        return MicroBatchParts(
            rows,
            prompts,
            ctx,
            sync,
            terms,
            tally,
            replay,
            router_aux is not None or isinstance(replay, BlockReplay),
            router_aux,
            full_gradient,
        )

    def _replay(
        self,
        inputs: dict[str, Any],
        terms: ResponseTerms,
        tally: LossTally,
        sync: GradientSync,
        backward: bool,
        entropy_grad: bool,
        router_aux: RouterAuxShares | None,
    ) -> BatchedReplay | BlockReplay:
        """How the micro-batch's rows are replayed: reverse block replay (with a backward and a block size: one
        response a batch, its blocks back-propagated in turn), else batched replays over :meth:`policy_replay`."""
        options = self.options
        if backward and options.replay_block_size is not None:
            return BlockReplay(
                options.replay_block_size,
                options.temperature,
                options.segment_checkpoint_layers,
                self.segment_context,
                inputs,
                terms,
                tally,
                sync,
                entropy_grad,
            )
        backward_fn = self.collectives.backward if backward else None
        return BatchedReplay(
            self.policy_replay, inputs, terms, tally, sync, backward_fn, entropy_grad, router_aux
        )

    def _loss_context(
        self, inputs: dict[str, Any], rows: MicroBatchRows, prompts: GroupPrompts, scaling: LossScaling
    ) -> LossNormalizer:
        """TRL's normalisers of the micro-batch, with its high-entropy mask where ``top_entropy_quantile < 1``."""
        entropy_mask = None
        if self.spec.top_entropy_quantile < 1.0:
            entropy_mask = top_entropy_mask(
                prompts,
                self.host,
                inputs,
                rows,
                self.options.temperature,
                self.spec.top_entropy_quantile,
                self.entropy_mask,
            )
        return batch_loss_context(
            self.spec,
            rows.loss_mask,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.collectives.num_processes,
            gradient_accumulation_steps=scaling.gradient_accumulation_steps,
            training=scaling.training,
            entropy_mask=entropy_mask,
            entropy_coef=scaling.entropy_coef,
        )

    def _group(self, model: nn.Module, parts: MicroBatchParts, g: int) -> None:
        """Group ``g``: its rows' terms (replayed in batches, or zero without loss tokens), then with the full
        gradient its prompt backward. Its state gradient is freed on return, before the next group's state."""
        entry = parts.prompts.entry(g)
        grads = None if parts.full_gradient is None else parts.full_gradient.state_grads(entry)
        plan = parts.sync.plan
        group = plan_group_replays(
            plan.rows_in_order(parts.rows.rows_of[g]),
            parts.ctx.lengths,
            plan.sync_row,
            parts.rows.loss_mask.size(1),
            self.options.replay_batch_tokens,
            one_at_a_time=parts.one_at_a_time,
            replay_empty=parts.router_aux is not None,
        )
        for i in group.skipped:
            parts.tally.add(*parts.terms.without_replay(i))
        for batch in group.batches:
            parts.replay.run(model, entry, g, batch, [group.lengths[i] for i in batch], grads)
        if parts.full_gradient is not None:
            segment_loss = None
            if (
                parts.router_aux is not None
            ):  # the prompt tokens' share of the router loss, with its gradient now
                segment_loss = parts.router_aux.prompt_segment_loss(len(parts.rows.rows_of[g]))
            parts.full_gradient.backward(model, g, entry, grads, segment_loss)


@dataclass(frozen=True)
class MicroBatchParts:
    """The parts one micro-batch runs through (:meth:`StreamedLoss.__call__`).

    Attributes:
        rows: its rows and their groups.
        prompts: each group's prompt state.
        ctx: TRL's normalisers.
        sync: which backward synchronises.
        terms: each response's term.
        tally: the sums and metrics.
        replay: a batch of rows replayed and back-propagated.
        one_at_a_time: one row a replay batch (reverse block replay; the router loss).
        router_aux: the router loss's shares (``None``: off).
        full_gradient: the prompt backwards (``None``: the response-only gradient).
    """

    rows: MicroBatchRows
    prompts: GroupPrompts
    ctx: LossNormalizer
    sync: GradientSync
    terms: ResponseTerms
    tally: LossTally
    replay: BatchedReplay | BlockReplay
    one_at_a_time: bool
    router_aux: RouterAuxShares | None
    full_gradient: FullGradientPrompts | None
