"""The MoE router load-balancing loss of TRL's GRPO, exactly, one response at a time.

What TRL 1.16 adds (``GRPOTrainer._compute_loss``): ``router_aux_loss_coef * aux_loss / ga`` (``ga``: the
accumulation steps in train mode, 1 in eval), where ``aux_loss`` is the model's own
``load_balancing_loss_func`` (transformers 5.23, identical in ``qwen3_moe``, ``qwen3_5_moe`` and
``qwen3_next``) over one forward of the whole micro-batch, prompt and completion tokens under the attention
mask. With ``L`` router calls (one per MoE layer), ``E`` experts, top-``k`` routing and, over every layer and
every unmasked token ``t`` of the micro-batch, ``p_{l,t} = softmax(router_logits_{l,t})``:

    C_e = sum_{l,t} [e in topk(p_{l,t}, k)]        (no gradient: indices)
    S_e = sum_{l,t} p_{l,t,e}
    M   = sum_l (unmasked tokens) = L * N
    aux = E * sum_e (C_e / M) * (S_e / M)

``C`` and ``M`` are constants of the micro-batch, so ``aux`` is linear in ``S``, and ``S`` is a sum over
tokens: given ``C`` and ``M`` from a graph-free pass, every response's share ``E * C . S_i / M^2`` is
differentiable in its own router probabilities and can be back-propagated with its replay. The prompt's first
``P - 1`` tokens are part of the captured state (constants under the response-only gradient, as they are for
the policy loss); their statistics are collected during the capture and enter ``C``, ``M`` and the value.
Each of the ``G`` rows of a group holds the whole prompt in TRL, so the prompt statistics count ``G`` times.
With ``gradient_mode="full"`` their share gets its gradient too: each capture chunk recomputed by the prompt
backward adds ``G`` times its tokens' share (:meth:`MicroBatchRouterAux.prompt_segment`), and the responses'
shares reach the prompt state through their replays like the policy loss.

TRL's input row is ``prompt + completion`` (``P + n`` tokens under the mask); a replay runs
``[last prompt token, completion[:-1]]``, so with the auxiliary loss on, a response is replayed one position
longer (``[last prompt token, completion]``): the last completion token is routed too (its log-prob output is
dropped).

Router logits reach this module through forward hooks on the model's router modules (the class HF records
``router_logits`` from, ``_can_record_outputs``), installed per call and removed after it; no host
synchronisation per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .context import ForwardContext, Mode
from .engine import forward_model
from .errors import LongStrawError, UnsupportedModelError
from .hooks import skip_head
from .model_patches import unwrap_model

__all__ = [
    "AUX_LOSS_MODEL_TYPES",
    "MicroBatchRouterAux",
    "RouterLoadBalancing",
    "RouterStats",
    "prepare_micro_batch",
    "replay_inputs",
]

AUX_LOSS_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "gpt_oss")
"""Model types whose HF forward returns the Switch load-balancing ``aux_loss`` (``load_balancing_loss_func``)."""


@dataclass
class RouterStats:
    """Sums over router calls and unmasked tokens (device tensors; see the module docstring).

    Parameters:
        counts (`torch.Tensor` of shape `[E]`): ``C``, top-k assignment counts (fp32).
        probs (`torch.Tensor` of shape `[E]`): ``S``, router probability sums (fp32, graph-free here).
        rows (`torch.Tensor`, scalar): ``M``, unmasked tokens summed over router calls (fp32).
    """

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.counts + other.counts, self.probs + other.probs, self.rows + other.rows)

    def __mul__(self, times: int) -> RouterStats:
        return RouterStats(self.counts * times, self.probs * times, self.rows * times)


class RouterLoadBalancing:
    """The load-balancing loss of one MoE policy: its routers, expert count and top-k.

    Args:
        model: the policy (peft / DDP wrappers are fine). Raises
            :class:`~longstraw_trl.errors.UnsupportedModelError` unless its HF forward computes the Switch
            load-balancing loss (``AUX_LOSS_MODEL_TYPES``).
    """

    def __init__(self, model: nn.Module):
        base = unwrap_model(model)
        config = base.config.get_text_config()
        model_type = getattr(config, "model_type", None)
        if model_type not in AUX_LOSS_MODEL_TYPES:
            raise UnsupportedModelError(
                f"router_aux_loss_coef != 0 on a {type(base).__name__} ({model_type}): its HF forward computes no "
                f"load-balancing aux_loss (transformers 5.23 computes one for {', '.join(AUX_LOSS_MODEL_TYPES)}), "
                "so TRL would have nothing to weight. Set router_aux_loss_coef=0.0."
            )
        recorder = None
        for module in base.modules():
            record = getattr(type(module), "_can_record_outputs", None) or {}
            if "router_logits" in record:
                recorder = record["router_logits"]
                break
        if recorder is None:
            raise UnsupportedModelError(f"{type(base).__name__} declares no router_logits to record")
        self.index = recorder.index
        self.routers = [m for m in base.modules() if isinstance(m, recorder.target_class)]
        if not self.routers:
            raise UnsupportedModelError(
                f"{type(base).__name__} has no {recorder.target_class.__name__} modules"
            )
        # GPT-OSS names it num_local_experts (its forward passes that to load_balancing_loss_func)
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self._sink = None  # where router logits go during a call: a list (stash) or a callable (stats)

    # --- hooks ---------------------------------------------------------------------------------------
    def _hook(self, module, args, output):
        if self._sink is not None:
            logits = output[self.index] if isinstance(output, (tuple, list)) else output
            self._sink(logits.reshape(-1, self.num_experts))

    @contextlib.contextmanager
    def _hooks(self, sink) -> Iterator[None]:
        if self._sink is not None:
            raise LongStrawError("router hooks are already installed (nested LongStraw router calls)")
        handles = [m.register_forward_hook(self._hook) for m in self.routers]
        self._sink = sink
        try:
            yield
        finally:
            self._sink = None
            for h in handles:
                h.remove()

    def stats(self, logits: torch.Tensor, mask: torch.Tensor | None) -> RouterStats:
        """One router call's ``(C, S, M)``: ``load_balancing_loss_func``'s per-layer ops (softmax in the
        logits' dtype, top-k of it, fp32 sums; ``mask`` ``[tokens]`` weights the tokens, ``None``: all)."""
        probs = torch.softmax(logits, dim=-1)
        _, selected = torch.topk(probs, self.top_k, dim=-1)
        if mask is None:
            mask = torch.ones(logits.shape[0], device=logits.device, dtype=torch.float32)
        mask = mask.to(device=logits.device, dtype=torch.float32)
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device).scatter_add_(
            0, selected.reshape(-1), mask.repeat_interleave(self.top_k)
        )
        return RouterStats(counts, (probs.float() * mask.unsqueeze(-1)).sum(0), mask.sum())

    @contextlib.contextmanager
    def collect(self, mask: torch.Tensor | None = None) -> Iterator[list[RouterStats]]:
        """Graph-free: every router call inside adds its statistics to the yielded one-element list.
        ``mask`` (``[tokens]``, flattened batch-major like the router input) weights each call's tokens."""
        total: list[RouterStats] = []

        def sink(logits):
            with torch.no_grad():
                s = self.stats(logits.detach(), mask)
            if total:
                total[0] = total[0] + s
            else:
                total.append(s)

        with self._hooks(sink):
            yield total

    @contextlib.contextmanager
    def stash(self) -> Iterator[list[torch.Tensor]]:
        """Keep the router logits of every call inside (with autograd), for :meth:`MicroBatchRouterAux.term`.
        Only the tensors are kept: under activation checkpointing the recomputed forward adds nothing."""
        kept: list[torch.Tensor] = []
        with self._hooks(kept.append):
            yield kept


@dataclass
class MicroBatchRouterAux:
    """A micro-batch's router statistics (all tokens, from capture + a graph-free pass), which make every
    response's share of TRL's ``aux_loss`` a differentiable sum over its own tokens.

    Parameters:
        lb (`RouterLoadBalancing`): the model's routers.
        totals (`RouterStats`): ``C``, ``S`` (graph-free) and ``M`` over the whole micro-batch.
        constant_probs (`torch.Tensor` of shape `[E]`): the part of ``S`` from tokens no replay routes again
            (the captured prompt tokens of every row).
    """

    lb: RouterLoadBalancing
    totals: RouterStats
    constant_probs: torch.Tensor

    @property
    def _scale(self) -> torch.Tensor:
        # aux = E * sum_e C_e S_e / M^2; the weight of S_e:
        return self.totals.counts * self.lb.num_experts / self.totals.rows.clamp(min=1.0) ** 2

    def value(self) -> torch.Tensor:
        """TRL's ``aux_loss`` of the micro-batch (detached, from the graph-free statistics)."""
        return (self._scale * self.totals.probs).sum()

    def constant(self) -> torch.Tensor:
        """The share of ``aux_loss`` no response carries: the captured prompt tokens' (no gradient)."""
        return (self._scale * self.constant_probs).sum()

    def term(self, router_logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """One response's share of ``aux_loss``, differentiable in its router logits (from :meth:`stash`
        around its replay); ``mask`` ``[tokens]`` marks the replay positions TRL's attention mask counts."""
        if not router_logits:
            raise LongStrawError("no router logits were recorded during the replay")
        scale = self._scale
        mask = mask.to(dtype=torch.float32)
        total = None
        for logits in router_logits:
            if torch.is_grad_enabled() and not logits.requires_grad:
                raise LongStrawError(
                    "the router logits of a replay carry no gradient (reentrant activation checkpointing runs the "
                    "layers under no_grad and hides them); use gradient_checkpointing_kwargs="
                    "{'use_reentrant': False} or replay_checkpoint_layers, or set router_aux_loss_coef=0.0"
                )
            probs = torch.softmax(logits, dim=-1).float()
            part = (probs * mask.to(probs.device).unsqueeze(-1)).sum(0) @ scale
            total = part if total is None else total + part
        return total

    @contextlib.contextmanager
    def prompt_segment(self, weight: float) -> Iterator[Callable[[], torch.Tensor]]:
        """The full gradient: around a recomputed chunk of captured prompt tokens (``prompt_backward``'s
        ``segment_loss``), yields a function giving ``weight`` times the chunk's share of ``aux_loss``,
        differentiable in its router logits (every token counts: TRL's mask covers the prompt). ``weight``: the
        rows of the micro-batch holding this prompt, times the loss's coefficient and normaliser."""
        with self.lb.stash() as router_logits:

            def share() -> torch.Tensor:
                tokens = router_logits[0].shape[0] if router_logits else 0
                mask = torch.ones(tokens, device=router_logits[0].device if router_logits else None)
                return weight * self.term(router_logits, mask)

            yield share


def replay_inputs(
    ids: torch.Tensor, mask: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One response's replay with the auxiliary loss on: ``ids``, ``mask`` its ``[R]`` completion row, ``length``
    the positions its policy loss needs. Returns ``(replay ids [W], router mask [W], keep)``: the replay runs
    ``[last prompt token, replay ids[:-1]]``, i.e. ``[last prompt token, completion]`` (``W = n + 1`` for ``n``
    completion tokens, at least ``length``); the router mask marks the positions TRL's attention mask counts
    (position 0, the last prompt token, and the completion tokens); the first ``keep`` log-probs are the loss's."""
    n = int(mask.sum())  # host sync: once per response, like the loss context's lengths
    width = max(length, n + 1)
    ext_ids = torch.cat([ids, ids.new_zeros(width)])[:width]  # the extra target's log-prob is dropped
    ext_mask = torch.cat([mask, mask.new_zeros(width)])[:width]
    router_mask = torch.cat([ext_mask.new_ones(1), ext_mask[: width - 1]])
    return ext_ids, router_mask, max(length, 1)


def prepare_micro_batch(
    lb: RouterLoadBalancing,
    model: nn.Module,
    groups: list[tuple[object, RouterStats, torch.Tensor, torch.Tensor]],
    max_tokens: int = 8192,
) -> MicroBatchRouterAux:
    """The micro-batch's statistics: per group ``(state, prompt_stats, completion_ids [G, R],
    completion_mask [G, R])``, ``prompt_stats`` those of the state's ``P - 1`` captured tokens (one row's).

    Graph-free forwards run ``[last prompt token, completion]`` for as many rows of a group at once as fit
    in ``max_tokens`` (at least one row; e.g. the capture chunk size, which bounds the capture's memory
    the same way). Right padding is masked, and neither attention nor routing lets a padded token change
    another."""
    totals = None
    constant = None
    with torch.no_grad():
        for state, prompt_stats, ids, mask in groups:
            g = ids.shape[0]
            width = int(mask.sum(1).max()) if mask.numel() else 0  # one host sync per group
            ids, mask = ids[:, :width].to(state.device), mask[:, :width].to(state.device)
            inputs = torch.cat([state.last_token.view(1, 1).expand(g, 1), ids], dim=1)
            token_mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
            rows = max(1, max_tokens // (width + 1))
            part = prompt_stats * g
            for start in range(0, g, rows):
                with lb.collect(token_mask[start : start + rows].reshape(-1)) as got:
                    ctx = ForwardContext(Mode.REPLAY, state)
                    batch = inputs[start : start + rows]
                    forward_model(model, batch, state.resident_tokens, ctx, head=skip_head, logits_to_keep=1)
                part = part + got[0]
            totals = part if totals is None else totals + part
            probs = prompt_stats.probs * g
            constant = probs if constant is None else constant + probs
    return MicroBatchRouterAux(lb, totals, constant)
