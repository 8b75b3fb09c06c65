"""The pre-flight plan: before a step's first capture, does it fit, and where does the prompt state live?

One decision, :func:`plan_step`, serves ``longstraw plan`` and the trainer alike: given what the planner plans
(:class:`~longstraw_trl.planner_inputs.PlanInputs`, whose ``gpu_memory_gib`` is the memory the step may use) and the
``offload_prompt_state`` asked for, it returns the settings chosen, or a refusal with the planner's table and the
changes that would fit. ``"auto"`` keeps the state on the device where that plan fits, else offloads it to host
memory where that plan fits, else refuses; ``None`` and ``"cpu"`` are planned as given.

:class:`StepPreflight` is the trainer's side: it gathers the plan's inputs from the model, the config and the device
(memory free at that moment, host memory), runs :func:`plan_step` at the first generation batch and again only when
the prompt tokens or the generations grow past what was planned, logs what it chose and why, and raises
:class:`PreflightError` before any capture when nothing fits.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .constants import AUTO, GradientMode
from .errors import LongStrawError, PreflightError, UnsupportedModelError
from .model_patches import unwrap_model
from .options import plan_options
from .planner import (
    SMALLEST_SUGGESTED_CHUNK,
    GiB,
    MemoryPlan,
    PlanInputs,
    Suggestion,
    check_plannable,
    format_plan,
    plan_memory,
    suggest_changes,
)

__all__ = [
    "AUTO_SETTINGS",
    "DEVICE_SHARE_OF_FREE",
    "PREFLIGHT_MARGIN",
    "PreflightDecision",
    "PreflightError",
    "StepPreflight",
    "host_memory_available",
    "plan_step",
]

logger = logging.getLogger(__name__)

DEVICE_SHARE_OF_FREE = 0.9
"""Of the GPU memory an offloaded plan leaves free of the budget, the share whole layers of the prompt state may take
on the device (:func:`plan_step`'s ``keep_on_device``): the rest of the free memory stays unplanned."""

AUTO_SETTINGS = ("capture_chunk_size", "replay_batch_tokens", "prompt_backward_checkpoint_layers")
"""The memory settings the pre-flight plan may choose: `"auto"` (`capture_chunk_size`, `replay_batch_tokens`), or
`None` in the full mode (`prompt_backward_checkpoint_layers`)."""

PREFLIGHT_MARGIN = 0.05
"""Fraction of the GPU's memory the trainer's pre-flight plan leaves unplanned when it reads the memory free on
the device (the planner's peaks are within a few percent of the measured ones; the allocator's fragmentation and
other processes take some more). A budget given as ``preflight_gpu_memory_bytes`` is used as it is."""


@dataclass
class PreflightDecision:
    """What :func:`plan_step` decided for one step.

    Args:
        requested: the ``offload_prompt_state`` asked for (``"auto"``, ``None`` or ``"cpu"``).
        offload_prompt_state: the one chosen (``"auto"`` resolved); the requested one when the step does not fit.
        plan: the plan of the chosen settings; when nothing fits, of the requested ones (``"auto"``: on the device).
        prompt_tokens: the prompt tokens planned.
        inputs: the plan's other inputs (its ``gpu_memory_gib`` is the budget).
        resident: ``"auto"``: the plan with the state on the device.
        offloaded: ``"auto"``: the plan with the state in host memory.
        suggestions: when nothing fits, the changes that would (each re-planned).
        device_state_bytes: with the state in host memory, the device share whole layers of it stay within (0:
            every layer streams); the plan counts it.
        settings: the ``"auto"`` memory settings chosen where they differ from the preferred ones (``{}``: none
            changed), as :class:`PlanInputs` fields.
    """

    requested: str | None
    offload_prompt_state: str | None
    plan: MemoryPlan
    prompt_tokens: int
    inputs: PlanInputs
    resident: MemoryPlan | None = None
    offloaded: MemoryPlan | None = None
    suggestions: list[Suggestion] = field(default_factory=list)
    device_state_bytes: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the chosen settings fit the GPU (and, offloaded, the host)."""
        return self.plan.fits

    @property
    def placement(self) -> str:
        """Where the prompt state lives, in words."""
        if self.offload_prompt_state is None:
            return "on the device"
        if not self.device_state_bytes:
            return "in host memory (offload_prompt_state='cpu')"
        return (
            f"in host memory (offload_prompt_state='cpu') but for whole layers kept on the device within "
            f"{self.device_state_bytes / GiB:.2f} GiB"
        )

    def reason(self) -> str:
        """Why: the peaks weighed against the budget, in one line."""
        budget = f"{self.plan.gpu_bytes / GiB:.2f} GiB"
        if self.settings and self.fits:
            changed = ", ".join(f"{name}={value!r}" for name, value in self.settings.items())
            preferred = (
                f"; with the preferred settings: on the device {_gib(self.resident)}, offloaded {_gib(self.offloaded)}"
                if self.requested == "auto"
                else ""
            )
            return f"with {changed} (chosen for 'auto'): peak {_gib(self.plan)} fits {budget}{preferred}"
        if self.requested != "auto":
            verdict = "fits" if self.fits else "does not fit"
            return f"offload_prompt_state={self.requested!r}: peak {_gib(self.plan)} {verdict} {budget}"
        resident, offloaded = self.resident, self.offloaded
        if resident.fits:
            return f"the state on the device: peak {_gib(resident)} fits {budget}"
        why = f"the state on the device: peak {_gib(resident)} > {budget}"
        if offloaded.fits:
            return (
                f"{why}; offloaded: peak {_gib(offloaded)} fits, {offloaded.host_bytes / GiB:.2f} GiB of host "
                f"memory of the {offloaded.host_memory / GiB:.2f} GiB a rank may use"
            )
        host = (
            ""
            if offloaded.fits_host
            else f", host {offloaded.host_bytes / GiB:.2f} GiB > {offloaded.host_memory / GiB:.2f} GiB"
        )
        return f"{why}; offloaded: peak {_gib(offloaded)}{host}: neither fits"

    def table(self) -> str:
        """The planner's table of :attr:`plan` (what ``longstraw plan`` prints)."""
        return format_plan(self.plan)


def _gib(plan: MemoryPlan) -> str:
    return f"{plan.peak / GiB:.2f} GiB"


def _shorter_response(
    config, prompt_tokens: int, inputs: PlanInputs, offloads: list[str | None]
) -> Suggestion | None:
    """The longest halving of the response (``max_completion_length``) at which the step fits, with one of
    ``offloads``; None where none does."""
    r = inputs.max_completion_length // 2
    while r >= 1:
        for offload in offloads:
            plan = plan_memory(
                config, prompt_tokens, inputs, max_completion_length=r, offload_prompt_state=offload
            )
            if plan.fits:
                options: dict[str, Any] = {"max_completion_length": r}
                args = ["--response", str(r)]
                if offload != inputs.offload_prompt_state:
                    options["offload_prompt_state"] = offload
                    args += ["--offload", str(offload)]
                return Suggestion.of(args, options, prompt_tokens, plan)
        r //= 2
    return None


def plan_step(
    config,
    prompt_tokens: int,
    inputs: PlanInputs,
    offload_prompt_state: str | None = "auto",
    vary_prompt: bool = True,
    vary_response: bool = False,
    keep_on_device: bool = True,
    auto: Collection[str] = (),
) -> PreflightDecision:
    """Plan one step and choose where its prompt state lives, or refuse with what would fit.

    Args:
        config: the model's (text) config.
        prompt_tokens: the prompt tokens the step holds.
        inputs: the step's other plan inputs; ``gpu_memory_gib`` is the GPU memory the step may use and
            ``host_memory_gib`` the host memory a rank may pin (its ``offload_prompt_state`` is replaced).
        offload_prompt_state: ``"auto"`` (on the device where that fits, else in host memory where that fits),
            ``None`` or ``"cpu"`` (planned as given).
        vary_prompt: when nothing fits, also suggest a shorter prompt.
        vary_response: when nothing fits, also suggest a shorter response (``max_completion_length``).
        keep_on_device: with the state in host memory and the response-only gradient: whole layers of it stay on
            the device within :data:`DEVICE_SHARE_OF_FREE` of what the plan leaves free of the budget
            (``device_state_bytes``, planned too); only the other layers stream.
        auto: the memory settings set to ``"auto"`` (names of :data:`AUTO_SETTINGS`): where the step does not fit
            with their preferred values (``inputs``'), each place of the state (``"auto"``: the device first) is
            planned with smaller ones (:func:`auto_candidates`) before the next place; the first that fits is taken.

    Returns:
        `PreflightDecision`: its ``fits`` says whether the chosen settings fit; when they do not, its
        ``suggestions`` are the changes that would (:func:`~longstraw_trl.planner_suggestions.suggest_changes`,
        plus a shorter response with ``vary_response``).
    """
    if offload_prompt_state not in ("auto", None, "cpu"):
        raise LongStrawError(
            f"offload_prompt_state must be 'auto', None or 'cpu', got {offload_prompt_state!r}"
        )
    resident = offloaded = None
    if offload_prompt_state == "auto":
        resident = plan_memory(config, prompt_tokens, inputs, offload_prompt_state=None)
        offloaded = plan_memory(config, prompt_tokens, inputs, offload_prompt_state="cpu")
    places = [None, "cpu"] if offload_prompt_state == "auto" else [offload_prompt_state]
    chosen, plan, settings = _first_fit(config, prompt_tokens, inputs, places, auto_candidates(inputs, auto))
    inputs = PlanInputs.of(inputs, **settings)
    share = 0
    if plan.fits and chosen == "cpu" and keep_on_device:
        plan, share = _with_device_share(config, prompt_tokens, inputs, plan)
    decision = PreflightDecision(
        offload_prompt_state,
        chosen,
        plan,
        prompt_tokens,
        inputs,
        resident,
        offloaded,
        device_state_bytes=share,
        settings=settings,
    )
    if plan.fits:
        return decision
    as_planned = PlanInputs.of(inputs, offload_prompt_state=chosen)
    decision.suggestions = suggest_changes(config, prompt_tokens, as_planned, vary_prompt=vary_prompt)
    if vary_response:
        shorter = _shorter_response(
            config, prompt_tokens, as_planned, [chosen, "cpu"] if offload_prompt_state == "auto" else [chosen]
        )
        if shorter is not None:
            decision.suggestions.append(shorter)
    return decision


def auto_candidates(inputs: PlanInputs, auto: Collection[str]) -> list[dict[str, Any]]:
    """The settings of the ``auto`` names to plan with, in order: the preferred (``inputs``') first, then fewer
    changes before more, each knob's smaller steps before its larger ones (ties: replay batching, prompt-backward
    checkpointing, capture chunk). ``auto``: names of :data:`AUTO_SETTINGS`."""
    steps: list[list[tuple[str, Any]]] = []
    if "replay_batch_tokens" in auto and inputs.replay_batch_tokens:
        tokens = inputs.replay_batch_tokens
        steps.append([("replay_batch_tokens", t) for t in (tokens // 2, tokens // 4, 0) if t < tokens])
    if "prompt_backward_checkpoint_layers" in auto and inputs.gradient_mode.full:
        if not inputs.segment_checkpoint_layers:
            steps.append([("prompt_backward_checkpoint_layers", True)])
    if "capture_chunk_size" in auto:
        chunk, smaller = inputs.capture_chunk_size, []
        while chunk // 2 >= SMALLEST_SUGGESTED_CHUNK:
            chunk //= 2
            smaller.append(("capture_chunk_size", chunk))
        steps.append(smaller)
    ranked = itertools.product(*[range(len(knob) + 1) for knob in steps])
    order = sorted(ranked, key=lambda levels: (sum(v > 0 for v in levels), sum(levels), [-v for v in levels]))
    return [dict(knob[v - 1] for knob, v in zip(steps, levels, strict=True) if v) for levels in order]


def _first_fit(
    config, prompt_tokens: int, inputs: PlanInputs, places: list[str | None], candidates: list[dict[str, Any]]
) -> tuple[str | None, MemoryPlan, dict[str, Any]]:
    """``(offload_prompt_state, plan, settings)``: the first of ``places`` (each with every candidate setting, in
    order) whose plan fits; where none does, the first place's plan with the preferred settings."""
    for place in places:
        for changes in candidates:
            plan = plan_memory(
                config, prompt_tokens, PlanInputs.of(inputs, **changes), offload_prompt_state=place
            )
            if plan.fits:
                return place, plan, changes
    return places[0], plan_memory(config, prompt_tokens, inputs, offload_prompt_state=places[0]), {}


def _with_device_share(
    config, prompt_tokens: int, inputs: PlanInputs, offloaded: MemoryPlan
) -> tuple[MemoryPlan, int]:
    """``(plan, device_state_bytes)``: the offloaded plan with whole layers kept on the device within a share of
    what it leaves free, or ``(offloaded, 0)`` when that keeps no layer or would not fit."""
    share = int(DEVICE_SHARE_OF_FREE * (offloaded.gpu_bytes - offloaded.peak))
    # the full gradient's fp32 dK/dV buffers live beside their pages: a kept layer's would take twice its bytes more
    # of the device, which the offloaded plan puts on the host
    if share <= 0 or inputs.gradient_mode.full:
        return offloaded, 0
    kept = PlanInputs.of(inputs, device_state_bytes=share)
    plan = plan_memory(config, prompt_tokens, kept, offload_prompt_state="cpu")
    if not plan.fits or plan.host_state >= offloaded.host_state:
        return offloaded, 0
    return plan, share


# ----------------------------------------------------------------------------------------------------------------------
# The trainer's side
# ----------------------------------------------------------------------------------------------------------------------
def host_memory_available() -> int | None:
    """Host memory available now (``MemAvailable`` of ``/proc/meminfo``, in bytes); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _config_change(s: Suggestion, prompt_tokens: int) -> str:
    """A suggestion in the trainer's terms: config fields, the adapter's rank, the prompts' length."""
    parts = []
    for name, value in s.options.items():
        if name == "lora_rank":
            parts.append(f"LoRA adapters of rank {value} (peft_config=LoraConfig(r={value}, ...))")
        else:
            parts.append(f"{name}={value!r}")
    if s.prompt_tokens < prompt_tokens:
        parts.append(f"prompts of at most {s.prompt_tokens:,} tokens")
    host = f", {s.host_bytes / GiB:.2f} GiB of host memory a rank" if s.host_bytes else ""
    return f"{' + '.join(parts)}  ->  peak {s.peak / GiB:.2f} GiB{host}"


def refusal_message(decision: PreflightDecision, budget_source: str) -> str:
    """The trainer's refusal: what was planned, the planner's table, the changes that fit and how to skip."""
    o = decision.inputs
    lines = [
        f"LongStrawGRPOTrainer pre-flight plan: the step does not fit ({decision.reason()}). Planned: "
        f"{decision.prompt_tokens:,} prompt tokens held at once, max_completion_length={o.max_completion_length}, "
        f"num_generations={o.num_generations}, offload_prompt_state={decision.requested!r}; GPU memory the step may "
        f"use: {o.gpu_memory_gib:.2f} GiB ({budget_source}). Nothing was captured and no checkpoint was touched.",
        decision.table(),
    ]
    if decision.suggestions:
        lines.append("Changes that fit (each re-planned; `longstraw plan` prints the same plan):")
        lines += [f"  {_config_change(s, decision.prompt_tokens)}" for s in decision.suggestions]
    else:
        lines.append(
            "No change tried fits (offload_prompt_state='cpu', a larger cp_size, LoRA adapters, "
            "replay_checkpoint_layers=True, a smaller capture_chunk_size, a shorter max_completion_length or "
            "shorter prompts)."
        )
    lines.append(
        "To run the step anyway, set preflight_plan=False; to plan against another budget, "
        "preflight_gpu_memory_bytes."
    )
    return "\n".join(lines)


class StepPreflight:
    """The trainer's pre-flight plan (see the module docstring).

    Args:
        model: the policy (any wrapper: PEFT, DDP, FSDP2).
        args: the trainer's config (``offload_prompt_state``, ``preflight_plan``, ``preflight_gpu_memory_bytes``,
            the planner's options: :func:`~longstraw_trl.options.plan_options`).
        device: the device the step runs on.
        fsdp_size: ranks FSDP2 shards the policy over (0: not wrapped).
    """

    def __init__(self, model: nn.Module, args: Any, device: torch.device, fsdp_size: int = 0):
        self.model, self.args, self.device, self.fsdp_size = model, args, device, fsdp_size
        self.decision: PreflightDecision | None = None
        #: the ``(prompt tokens, generations)`` planned so far; a step within them is not planned again
        self.planned: tuple[int, int] | None = None
        self.offload_prompt_state: str | None = (
            None if args.offload_prompt_state == "auto" else args.offload_prompt_state
        )
        #: with the state in host memory: the device share whole layers of a batch's states stay within (0: none)
        self.device_state_bytes = 0
        #: the ``"auto"`` memory settings the last plan changed from their preferred values
        self.settings: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        """Whether a plan is made: ``preflight_plan`` and either a GPU or a budget given."""
        return bool(self.args.preflight_plan) and (
            self.device.type == "cuda" or self.args.preflight_gpu_memory_bytes is not None
        )

    def before_capture(self, prompt_lengths: list[int], num_generations: int) -> str | None:
        """Plan the step whose prompts (each held at once) have ``prompt_lengths`` tokens, when it holds more prompt
        tokens or generations than planned so far; returns the ``offload_prompt_state`` to capture with. Raises
        :class:`PreflightError` when nothing fits."""
        if self.planned is None and not self.active:
            self.planned = (0, 0)
            if self.args.offload_prompt_state == "auto":
                why = (
                    "preflight_plan=False"
                    if not self.args.preflight_plan
                    else "no GPU and no preflight_gpu_memory_bytes"
                )
                logger.info(
                    "LongStraw pre-flight plan: not made (%s); offload_prompt_state='auto' keeps the prompt state on the device",
                    why,
                )
            return self.offload_prompt_state
        if not self.active:
            return self.offload_prompt_state
        tokens, generations, budget = self._gathered(sum(prompt_lengths), num_generations)
        if self.planned is not None and tokens <= self.planned[0] and generations <= self.planned[1]:
            return self.offload_prompt_state
        if self.planned is not None:  # the envelope of every step planned so far
            tokens, generations = max(tokens, self.planned[0]), max(generations, self.planned[1])
        self.planned = (tokens, generations)
        decision = self._decide(tokens, generations, budget)
        if decision is None:
            return self.offload_prompt_state
        self.decision = decision
        if not decision.fits:
            raise PreflightError(refusal_message(decision, self._budget_source()))
        self.offload_prompt_state = decision.offload_prompt_state
        self.device_state_bytes = decision.device_state_bytes
        self.settings = decision.settings
        # offloading by itself slows every decode step: say so where TRL's default logging shows it
        log = (
            logger.warning if decision.requested == "auto" and decision.offload_prompt_state else logger.info
        )
        log(
            "LongStraw pre-flight plan (%s prompt tokens, max_completion_length=%d, num_generations=%d): prompt "
            "state %s, since %s",
            f"{tokens:,}",
            decision.inputs.max_completion_length,
            generations,
            decision.placement,
            decision.reason(),
        )
        return self.offload_prompt_state

    def _decide(self, tokens: int, generations: int, budget: int) -> PreflightDecision | None:
        base = unwrap_model(self.model)
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        try:
            check_plannable(getattr(config, "model_type", None))
        except UnsupportedModelError as error:
            logger.warning("LongStraw pre-flight plan: not made (%s)", error)
            return None
        inputs = self.plan_inputs(generations, budget)
        keep = self.args.offload_keep_layers_on_device
        return plan_step(
            config,
            tokens,
            inputs,
            self.args.offload_prompt_state,
            vary_response=True,
            keep_on_device=keep,
            auto=auto_settings(self.args),
        )

    def plan_inputs(self, num_generations: int, gpu_bytes: int) -> PlanInputs:
        """The planner's inputs of this trainer's step: its config's options, the model's dtype and adapters, the
        budget and this rank's share of the host's available memory."""
        options = plan_options(self.args)
        options.pop("offload_prompt_state")
        options["num_generations"] = num_generations
        lora_rank, adapter_bytes = _adapters(self.model)
        host = host_memory_available()
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        changes: dict[str, Any] = dict(
            max_completion_length=self.args.max_completion_length,
            page_size=self.args.page_size,
            fsdp_size=self.fsdp_size,
            lora_rank=lora_rank,
            adapter_dtype_bytes=adapter_bytes,
            dtype_bytes=_weight_bytes(self.model),
            gpu_memory_gib=gpu_bytes / GiB,
        )
        if host is not None:
            changes["host_memory_gib"] = host / max(ranks, 1) / GiB
        return PlanInputs.of(None, **options, **changes)

    def _budget(self) -> int:
        """The GPU memory the step may use: ``preflight_gpu_memory_bytes``, else what the device has free plus what
        this process holds already (the weights are in the plan), less :data:`PREFLIGHT_MARGIN` of the card."""
        if self.args.preflight_gpu_memory_bytes is not None:
            return int(self.args.preflight_gpu_memory_bytes)
        free, total = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - int(PREFLIGHT_MARGIN * total)

    def _budget_source(self) -> str:
        if self.args.preflight_gpu_memory_bytes is not None:
            return "preflight_gpu_memory_bytes"
        return f"free on the device plus what this process holds, less {PREFLIGHT_MARGIN:.0%} of the card"

    def _gathered(self, tokens: int, generations: int) -> tuple[int, int, int]:
        """The prompt tokens and generations to plan, and the budget: over every rank, the most tokens and
        generations and the smallest budget, so that every rank decides the same."""
        budget = self._budget()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return tokens, generations, budget
        values = torch.tensor([tokens, generations, -budget], dtype=torch.int64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return int(values[0]), int(values[1]), -int(values[2])


def auto_settings(args: Any) -> tuple[str, ...]:
    """The names of :data:`AUTO_SETTINGS` a config leaves to the pre-flight plan: ``"auto"`` values, and
    ``prompt_backward_checkpoint_layers=None`` in the full mode."""
    names = [name for name in ("capture_chunk_size", "replay_batch_tokens") if getattr(args, name) == AUTO]
    if args.prompt_backward_checkpoint_layers is None and GradientMode.parse(args.gradient_mode).full:
        names.append("prompt_backward_checkpoint_layers")
    return tuple(names)


def _adapters(model: nn.Module) -> tuple[int | None, int | None]:
    """``(LoRA rank, bytes of a trained adapter element)`` of a PEFT model's active adapter; ``(None, None)``
    without adapters."""
    peft_model = model
    while not hasattr(peft_model, "peft_config") and isinstance(
        getattr(peft_model, "module", None), nn.Module
    ):
        peft_model = peft_model.module
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None, None
    active = getattr(peft_model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else None
    config = config or next(iter(configs.values()))
    rank = getattr(config, "r", None)
    trained = next((p for p in model.parameters() if p.requires_grad), None)
    return (rank or None), (trained.element_size() if trained is not None and rank else None)


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of an element of the model's weights (its frozen ones, with adapters)."""
    frozen = next((p for p in model.parameters() if not p.requires_grad), None)
    param = frozen if frozen is not None else next(model.parameters(), None)
    return param.element_size() if param is not None else 2
