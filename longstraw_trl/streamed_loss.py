"""The GRPO step's loss: TRL's `_compute_loss` value for one micro-batch, computed (and back-propagated) one response,
or one batch of a group's responses, at a time on the groups' prompt states.

A micro-batch goes through :meth:`StreamedLoss.__call__` in this order:

1. **rows**: each row's group (``longstraw_row_group``), the rows of each group, each row's loss length;
2. **entropy mask** (``top_entropy_quantile < 1``): a graph-free replay of every response, TRL's quantile mask;
3. **scaling**: :func:`~longstraw_trl.loss.batch_loss_context` (TRL's normalisers for every loss type);
4. **sync plan** (:func:`plan_sync`): under DDP, which backward synchronises the gradients (the longest response's,
   run last; or, with the full gradient, the last group's prompt backward) and which run under ``no_sync``;
5. **router statistics** (a MoE load-balancing loss): the whole micro-batch's, graph-free, before any term;
6. for each group (sync plan's order): its prompt state (:class:`~longstraw_trl.prompt_state_manager.PromptStateManager`), then
   its rows cut into replay batches (:func:`replay_batches`), each replayed under autograd
   (:meth:`StreamedLoss.policy_replay`; reverse block replay one response at a time; the router's share one position
   longer), its terms (:func:`~longstraw_trl.loss.response_loss`) checked finite and back-propagated together;
   with the full gradient, the group's prompt backward (:func:`~longstraw_trl.engine.prompt_backward`) after its
   replays;
7. **metrics**: TRL's, aggregated over processes, and the replay's throughput.

No TRL trainer here: the host supplies the phase and metrics (:class:`~longstraw_trl.prompt_state_manager.StepHost`) and the
collectives (:class:`Collectives`: Accelerate's ``Accelerator`` is one; :class:`SingleProcess` for one process).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .engine import checkpointing_off, prompt_backward, replay_blocks_backward, replay_logprobs
from .errors import LongStrawError, NonFiniteLossError
from .fused_forwards import replay_forwards
from .loss import (
    GRPOLossSpec,
    aggregate_metrics,
    batch_loss_context,
    loss_lengths,
    response_loss,
)
from .options import LossOptions
from .prompt_state import PromptState
from .prompt_state_manager import PromptStateManager, StepHost, peak_memory_gib
from .router_aux import RouterLoadBalancing, prepare_micro_batch, replay_inputs
from .state_cache import CachedPrompt
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
class SyncPlan:
    """When the gradients of a micro-batch are synchronised across processes (DDP reduces in the backward of the
    last micro-batch of an optimizer step; every other backward of that micro-batch must run under ``no_sync``).

    Attributes:
        group_order: the order the groups are processed in (the synchronising group last).
        sync_row: the response whose backward synchronises (run last in its group); ``None`` without DDP, and with
            the full gradient, whose last prompt backward synchronises instead.
        ddp: several processes and a backward.
        full: the full gradient.
    """

    group_order: list[int]
    sync_row: int | None
    ddp: bool
    full: bool

    def rows_in_order(self, rows: list[int]) -> list[int]:
        """A group's rows, the synchronising response last."""
        rows = list(rows)
        if self.sync_row in rows:
            rows.remove(self.sync_row)
            rows.append(self.sync_row)
        return rows

    def batch_skips_sync(self, batch: list[int]) -> bool:
        """Whether a replay batch's backward runs under ``no_sync``."""
        return (self.sync_row is not None and self.sync_row not in batch) or (self.full and self.ddp)

    def prompt_backward_syncs(self, group: int) -> bool:
        """Whether a group's prompt backward (the full gradient) ends with the synchronising backward."""
        return self.ddp and group == self.group_order[-1]


def plan_sync(row_group: list[int], lengths: list[int], num_groups: int, ddp: bool, full: bool) -> SyncPlan:
    """The :class:`SyncPlan` of a micro-batch: under DDP the longest response synchronises (its group processed
    last); a process without any loss token still takes part, with its first row's zero-weighted replay."""
    group_order = list(range(num_groups))
    sync_row = None
    if ddp:
        with_tokens = [i for i in range(len(row_group)) if lengths[i] > 0]
        sync_row = max(with_tokens, key=lambda i: lengths[i]) if with_tokens else 0
        group_order.remove(row_group[sync_row])
        group_order.append(row_group[sync_row])
    if full:  # every replay under no_sync; the last group's prompt backward synchronises
        sync_row = None
    return SyncPlan(group_order, sync_row, ddp, full)


def replay_batches(
    rows: list[int], lengths: dict[int, int], budget: int, one_at_a_time: bool
) -> list[list[int]]:
    """``rows`` (of one prompt group, in order; ``lengths``: the positions each replays) cut into the batches replayed
    together under autograd: consecutive rows while the batch's padded tokens (rows x longest) stay within
    ``budget``. One row a batch when ``budget`` is 0 or with ``one_at_a_time`` (the router auxiliary loss, whose
    replays run one position longer; reverse block replay, back-propagated block by block)."""
    if one_at_a_time or budget <= 0:
        return [[i] for i in rows]
    batches: list[list[int]] = []
    longest = 0
    for i in rows:
        length = lengths[i]
        if batches and (len(batches[-1]) + 1) * max(longest, length) <= budget:
            batches[-1].append(i)
            longest = max(longest, length)
        else:
            batches.append([i])
            longest = length
    return batches


def split_by_groups(
    batch: dict[str, Any], num_chunks: int, order: list[int] | None = None
) -> list[dict[str, Any]]:
    """Split a generation batch's rows into ``num_chunks`` micro-batches, its groups taken in ``order`` (default: a
    random permutation, as TRL shuffles the rows of a generation batch).

    A micro-batch holds the prompts of the groups it has rows of (``longstraw_prompts``) and, per row, the index of
    its prompt among them (``longstraw_row_group``); a group cut by a micro-batch boundary is replayed from the same
    cached state in both micro-batches."""
    prompts = batch["longstraw_prompts"]
    rows = batch["completion_ids"].size(0)
    size = rows // len(prompts)
    if rows % num_chunks != 0:
        raise LongStrawError(
            f"a generation batch of {rows} completions cannot be split into {num_chunks} equal micro-batches"
        )
    if order is None:
        order = torch.randperm(len(prompts)).tolist()
    row_order = torch.cat([torch.arange(g * size, (g + 1) * size) for g in order])
    per_chunk = rows // num_chunks
    chunks = []
    for c in range(num_chunks):
        index = row_order[c * per_chunk : (c + 1) * per_chunk]
        row_groups = (index // size).tolist()
        group_ids = list(dict.fromkeys(row_groups))  # in order of appearance
        position = {g: j for j, g in enumerate(group_ids)}
        chunk = {}
        for name, value in batch.items():
            if name == "longstraw_prompts":
                chunk[name] = [prompts[g] for g in group_ids]
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == rows:
                chunk[name] = value[index.to(value.device)]
            else:
                chunk[name] = value
        chunk["longstraw_row_group"] = torch.tensor([position[g] for g in row_groups])
        chunks.append(chunk)
    return chunks


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
    def _loss_entry(self, entries: dict, inputs: dict[str, Any], g: int, rows: list[int], lengths, loss_mask):
        """Group ``g``'s prompt state for the loss (its rows ``rows`` of the micro-batch), acquired (refresh policy,
        adaptive probe) once per micro-batch."""
        if g not in entries:
            key, prompt_ids = inputs["longstraw_prompts"][g]
            entry = self.prompt_states.acquire(key, prompt_ids, purpose="loss")
            if entry.probe_stale is not None:
                probe = next((i for i in rows if lengths[i] > 0), None)
                if probe is not None:
                    self.prompt_states.finish_probe(
                        entry, inputs["completion_ids"][probe], loss_mask[probe], self.options.temperature
                    )
                else:
                    entry.probe_stale = None
            entries[g] = entry
        return entries[g]

    def _high_entropy_mask(self, model, entries: dict, inputs: dict[str, Any], rows_of, lengths, loss_mask):
        """TRL's ``top_entropy_quantile`` token mask of the micro-batch, from a graph-free entropy pass.

        TRL takes the quantile over the entropies of the whole micro-batch (all processes) before any loss term; the
        loss here replays one response at a time, so every response with loss tokens is first replayed without
        autograd (one forward per group, its rows batched, on the state the loss then uses) and TRL's own
        ``get_high_entropy_mask`` runs on those entropies. The mask is a comparison, so it needs no gradient. Its
        entropies match the loss replay's to float rounding (~1e-6): a token's membership could differ from TRL's
        single-forward mask only if its entropy lies that close to the threshold."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        entropies = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        start = time.perf_counter()
        policy = self.prompt_states.model
        for g in range(len(inputs["longstraw_prompts"])):
            rows = rows_of[g]
            length = max(lengths[i] for i in rows) if rows else 0
            if length == 0:
                continue
            entry = self._loss_entry(entries, inputs, g, rows, lengths, loss_mask)
            with self.host.graph_free(policy):
                _, h = replay_logprobs(
                    entry.state,
                    policy,
                    completion_ids[rows, :length],
                    completion_mask[rows, :length],
                    self.options.temperature,
                    return_entropy=True,
                )
            entropies[rows, :length] = h.to(entropies.device)
        self.host.phase_metrics()["longstraw/entropy_pass_seconds"].append(time.perf_counter() - start)
        return self.entropy_mask(entropies, loss_mask, 1 - self.spec.top_entropy_quantile)

    def _micro_batch_router_aux(self, model, entries: dict, completion_ids, completion_mask, rows_of):
        """The router statistics of the whole micro-batch (graph-free), for TRL's load-balancing loss."""
        groups = []
        for g, entry in entries.items():
            stats = self.prompt_states.router_prompt_stats(entry)
            rows = rows_of[g]
            groups.append((entry.state, stats, completion_ids[rows], completion_mask[rows]))
        with self.host.graph_free(model):
            return prepare_micro_batch(self.router_aux, model, groups, self.options.capture_chunk_size)

    def _policy_replay_with_router_aux(
        self, model, state, aux, ids, mask, length: int, entropy_grad: bool = False, grads=None
    ):
        """:meth:`policy_replay` one position longer (``[last prompt token, completion]``: TRL routes every
        completion token under its mask), plus the response's differentiable share of the load-balancing loss."""
        ext_ids, router_mask, keep = replay_inputs(ids, mask, length)
        with self.router_aux.stash() as router_logits:
            logps, entropies = self.policy_replay(
                model,
                state,
                ext_ids[None],
                torch.ones_like(ext_ids)[None],
                entropy_grad=entropy_grad,
                grads=grads,
            )
        return logps[0, :keep], entropies[0, :keep], aux.term(router_logits, router_mask)

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
        spec, options, collectives = self.spec, self.options, self.collectives
        metrics_sink = self.host.phase_metrics()
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        prompts = inputs["longstraw_prompts"]
        num_rows, width = completion_ids.shape
        row_group = inputs.get("longstraw_row_group")
        if row_group is None:  # whole groups, in order
            row_group = torch.arange(num_rows) // (num_rows // len(prompts))
        row_group = row_group.tolist()
        rows_of = [[i for i in range(num_rows) if row_group[i] == g] for g in range(len(prompts))]
        lengths = loss_lengths(loss_mask)
        entries: dict[int, CachedPrompt] = {}
        entropy_mask = None
        if spec.top_entropy_quantile < 1.0:
            entropy_mask = self._high_entropy_mask(model, entries, inputs, rows_of, lengths, loss_mask)
        ctx = batch_loss_context(
            spec,
            loss_mask,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=collectives.num_processes,
            gradient_accumulation_steps=scaling.gradient_accumulation_steps,
            training=scaling.training,
            entropy_mask=entropy_mask,
            entropy_coef=scaling.entropy_coef,
        )
        # the entropies carry a graph only where the bonus contributes to the gradient
        entropy_grad = backward and spec.entropy_bonus_enabled and ctx.entropy_coef != 0.0
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps")
        sampling = inputs.get("sampling_per_token_logps")
        advantages = inputs["advantages"]
        device = completion_ids.device

        ddp = backward and collectives.num_processes > 1
        full = backward and options.gradient_mode.full
        blocks = backward and options.replay_block_size is not None
        plan = plan_sync(row_group, ctx.lengths, len(prompts), ddp, full)
        sync_row = plan.sync_row

        def cut(x, i, length):
            return None if x is None else x[i, :length]

        total = torch.zeros((), device=self.host.device)
        all_metrics = []
        replay_seconds, replay_tokens = 0.0, 0
        aux = None
        if self.router_aux is not None:  # every state first: the router statistics span the micro-batch
            for g in plan.group_order:
                self._loss_entry(entries, inputs, g, rows_of[g], lengths, loss_mask)
            aux = self._micro_batch_router_aux(model, entries, completion_ids, completion_mask, rows_of)
            total = total + spec.router_aux_loss_coef * aux.constant() / ctx.ga_normalizer
        no_sync = (lambda: collectives.no_sync(model)) if ddp else None
        for g in plan.group_order:
            entry = self._loss_entry(entries, inputs, g, rows_of[g], lengths, loss_mask)
            grads = StateGrads(entry.state) if full else None
            replayed = []
            for i in plan.rows_in_order(rows_of[g]):
                if ctx.lengths[i] == 0 and i != sync_row and aux is None:
                    # No loss token: its term is exactly zero (TRL's sums multiply it by the mask); no replay.
                    zeros = torch.zeros(1, device=device)
                    term, metrics = response_loss(
                        spec, ctx, i, zeros, cut(old, i, 1), cut(ref, i, 1), advantages[i], entropies_i=zeros
                    )
                    all_metrics.append(metrics)
                    total = total + term.detach()
                    continue
                replayed.append(i)
            # a 1-token replay skips the decoder layers, whose parameters DDP expects: the sync row replays >= 2
            replay_length = {
                i: max(ctx.lengths[i], min(2, width)) if i == sync_row else ctx.lengths[i] for i in replayed
            }
            batches = replay_batches(
                replayed, replay_length, options.replay_batch_tokens, aux is not None or blocks
            )
            for batch in batches:
                lengths_b = [replay_length[i] for i in batch]
                sync = collectives.no_sync(model) if plan.batch_skips_sync(batch) else _NULL_CONTEXT
                start = time.perf_counter()
                with sync:
                    # reverse block replay: one response a batch (`replay_batches`), its blocks back-propagated in turn
                    if blocks:
                        (i,), (length,) = batch, lengths_b
                        term, metrics = self._block_replay_term(
                            model,
                            entry,
                            inputs,
                            ctx,
                            i,
                            g,
                            length,
                            entropy_grad,
                            grads,
                            sync_row == i,
                            scaling,
                        )
                        replay_seconds += time.perf_counter() - start
                        replay_tokens += length
                        total = total + term
                        all_metrics.append(metrics)
                        continue
                    if aux is None:
                        longest = max(lengths_b)
                        logps_b, entropies_b = self.policy_replay(
                            model,
                            entry.state,
                            completion_ids[batch, :longest],
                            completion_mask[batch, :longest],
                            entropy_grad=entropy_grad,
                            grads=grads,
                        )
                    batch_term = None
                    for j, (i, length) in enumerate(zip(batch, lengths_b, strict=True)):
                        if aux is None:
                            logps, entropies = logps_b[j, :length], entropies_b[j, :length]
                        else:
                            logps, entropies, aux_term = self._policy_replay_with_router_aux(
                                model,
                                entry.state,
                                aux,
                                completion_ids[i],
                                completion_mask[i],
                                length,
                                entropy_grad,
                                grads,
                            )
                            length = max(length, 1)  # a row without completion tokens still routes its prompt
                        term, metrics = response_loss(
                            spec,
                            ctx,
                            i,
                            logps,
                            cut(old, i, length),
                            cut(ref, i, length),
                            advantages[i],
                            sampling_logps_i=cut(sampling, i, length),
                            entropies_i=entropies,
                        )
                        if not torch.isfinite(term.detach()):
                            raise_non_finite(term, i, g, entry, length, logps, old, ref, advantages, scaling)
                        if ctx.lengths[i] == 0:
                            term = term * 0.0
                        if aux is not None:
                            term = term + spec.router_aux_loss_coef * aux_term / ctx.ga_normalizer
                        batch_term = term if batch_term is None else batch_term + term
                        replay_tokens += length
                        total = total + term.detach()
                        all_metrics.append(metrics)
                    if backward:
                        collectives.backward(batch_term)
                replay_seconds += time.perf_counter() - start
                del logps, entropies, term, batch_term
                if aux is None:
                    del logps_b, entropies_b
            if full:
                # the step's peak before this group's prompt backward (captures, generation and replays so far): the
                # prompt backward's own peak is the step's when the step's is higher
                peak = peak_memory_gib(self.host.device)
                if peak is not None:
                    metrics_sink["longstraw/peak_before_prompt_backward_gib"].append(peak)
                start = time.perf_counter()
                last = plan.prompt_backward_syncs(g)
                if last and entry.state.resident_tokens == 0:
                    raise LongStrawError(
                        "gradient_mode='full' under DDP needs the last prompt of a micro-batch to have more than one "
                        "token (its prompt backward synchronises the gradients)."
                    )
                segment_loss = None
                if aux is not None:  # the prompt tokens' share of the router loss, with its gradient now
                    weight = len(rows_of[g]) * spec.router_aux_loss_coef / ctx.ga_normalizer
                    segment_loss = functools.partial(aux.prompt_segment, weight)
                with self.segment_context(model):
                    prompt_backward(
                        entry.state,
                        model,
                        grads,
                        checkpoint_layers=options.prompt_segment_checkpoint_layers,
                        no_sync=no_sync,
                        sync_last=last,
                        segment_loss=segment_loss,
                    )
                metrics_sink["longstraw/prompt_backward_seconds"].append(time.perf_counter() - start)
                del grads

        for name, value in aggregate_metrics(
            spec,
            all_metrics,
            reduce_sum=lambda t: collectives.reduce(t, reduction="sum"),
            gather=collectives.gather,
        ).items():
            metrics_sink[name].append(value)
        bonus_entropy = None
        if spec.entropy_bonus_enabled:
            bonus_entropy = torch.stack([m.bonus_entropy for m in all_metrics]).sum(0)
        if aux is not None:  # TRL: `gather_for_metrics(aux_loss).mean()`, before the coefficient
            metrics_sink["aux_loss"].append(collectives.gather_for_metrics(aux.value()).mean().item())
        metrics_sink["longstraw/replay_seconds"].append(replay_seconds)
        metrics_sink["longstraw/replay_tokens_per_second"].append(replay_tokens / max(replay_seconds, 1e-9))
        return total, bonus_entropy

    def _block_replay_term(self, model, entry, inputs, ctx, i, g, length, entropy_grad, grads, sync, scaling):
        """Response ``i`` by reverse block replay: its loss term (detached, back-propagated) and metrics."""
        spec, options = self.spec, self.options
        old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
        sampling, advantages = inputs.get("sampling_per_token_logps"), inputs["advantages"]
        ids = inputs["completion_ids"][i : i + 1, :length]
        kept = {}

        def cut(x):
            return None if x is None else x[i, :length]

        def loss_term(logps, entropies):
            term, metrics = response_loss(
                spec,
                ctx,
                i,
                logps,
                cut(old),
                cut(ref),
                advantages[i],
                sampling_logps_i=cut(sampling),
                entropies_i=entropies,
            )
            if not torch.isfinite(term.detach()):
                raise_non_finite(term, i, g, entry, length, logps, old, ref, advantages, scaling)
            kept.setdefault("metrics", metrics)  # the first block's: every block sees the same values
            return term * 0.0 if ctx.lengths[i] == 0 else term

        no_sync = (lambda: self.collectives.no_sync(model)) if sync else None
        with self.segment_context(model):
            _, _, term = replay_blocks_backward(
                entry.state,
                model,
                ids,
                options.replay_block_size,
                loss_term,
                options.temperature,
                grads=grads,
                return_entropy=True,
                entropy_grad=entropy_grad,
                checkpoint_layers=options.segment_checkpoint_layers,
                no_sync=no_sync,
            )
        return term, kept["metrics"]


def raise_non_finite(term, i, g, entry, length, logps, old, ref, advantages, scaling: LossScaling):
    """Stop before back-propagating a non-finite term, naming the inputs that are not finite."""
    suspects = []
    if not torch.isfinite(logps.detach()).all():
        suspects.append("the policy log-probs (diverged weights? lower the learning rate)")
    if old is not None and not torch.isfinite(old[i, :length]).all():
        suspects.append("the old-policy log-probs")
    if ref is not None and not torch.isfinite(ref[i, :length]).all():
        suspects.append("the reference log-probs")
    if not torch.isfinite(advantages[i]).all():
        suspects.append("the advantage (check the reward functions)")
    raise NonFiniteLossError(
        f"non-finite loss ({term.item()}) at global step {scaling.global_step + 1} (micro-step {scaling.micro_step}), "
        f"group {g} of the micro-batch (prompt {entry.key}, {entry.prompt_ids.numel()} tokens), response {i} "
        f"({length} tokens); non-finite inputs: {', '.join(suspects) or 'none (the loss terms overflowed)'}. "
        "Training stopped before back-propagating it."
    )
