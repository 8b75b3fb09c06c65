"""What to change when a plan does not fit: each change re-planned (:func:`suggest_changes`)."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

from .planner_inputs import GiB, PlanInputs
from .planner_memory import MemoryPlan, largest_prompt, plan_memory
from .planner_terms import count_parameters

# The LoRA rank a plan that does not fit is re-planned with (a common default, not a recommendation).
SUGGESTED_LORA_RANK = 64
# the smallest capture chunk a suggestion names: below it a chunk's GEMMs stop filling the GPU
SMALLEST_SUGGESTED_CHUNK = 1024

#: a change: its ``longstraw plan`` flags and the :class:`PlanInputs` fields it sets
Lever = tuple[list[str], dict[str, Any]]


@dataclass
class Suggestion:
    """A change that makes a plan fit, found by re-planning with it (see :func:`suggest_changes`).

    Args:
        args: the ``longstraw plan`` flags of the change, e.g. ``["--lora-rank", "64", "--cp", "2"]``.
        options: the :class:`~longstraw_trl.planner_inputs.PlanInputs` fields it changes, which
            :func:`~longstraw_trl.planner_memory.plan_memory` takes as keywords (``--prompt`` is ``prompt_tokens``
            instead).
        prompt_tokens: the prompt length of the re-plan (smaller than asked only for a ``--prompt`` change).
        peak: per-rank peak bytes of the re-plan, at most the GPU's memory.
        host_bytes: host memory per rank the change needs (``--offload cpu``), 0 otherwise.
        host_pinned_bytes: what of it is pinned (:attr:`MemoryPlan.host_pinned_bytes`).
    """

    args: list[str]
    options: dict[str, Any]
    prompt_tokens: int
    peak: int
    #: host memory the change needs (``--offload cpu``: the offloaded state, full mode's buffers), 0 otherwise
    host_bytes: int = 0
    #: what of :attr:`host_bytes` is pinned
    host_pinned_bytes: int = 0

    @classmethod
    def of(cls, args: list[str], options: dict[str, Any], prompt_tokens: int, plan: MemoryPlan) -> Suggestion:
        """The suggestion whose re-plan (at ``prompt_tokens``) is ``plan``."""
        return cls(args, options, prompt_tokens, plan.peak, plan.host_bytes, plan.host_pinned_bytes)

    def as_dict(self) -> dict:
        return asdict(self)


def _smallest_cp(config, prompt_tokens: int, o: PlanInputs) -> tuple[int, MemoryPlan] | None:
    """``(cp_size, its plan)`` for the smallest power of two above the current ``cp_size`` that fits, or None."""
    pages = -(-prompt_tokens // o.page_size)
    cp = 1
    while cp <= o.cp_size:
        cp *= 2
    while True:
        plan = plan_memory(config, prompt_tokens, o, cp_size=cp)
        if plan.fits:
            return cp, plan
        if cp >= pages:  # every rank already holds a single page: more ranks save nothing
            return None
        cp *= 2


def _suggested_chunk(config, prompt_tokens: int, o: PlanInputs, peak: int) -> int | None:
    """The largest power-of-two fraction of the capture chunk (down to :data:`SMALLEST_SUGGESTED_CHUNK`) at which
    the plan fits, else the smallest one where it lowers the plan's ``peak`` (for combinations); ``None`` where a
    smaller chunk does not lower it. The chunk sets the capture's activations and, in the full gradient mode, the
    prompt backward's graph, kept page parts and chunk recompute, which dominate that mode's peak."""
    current = o.capture_chunk_size
    smaller = [
        current >> k for k in range(1, current.bit_length()) if current >> k >= SMALLEST_SUGGESTED_CHUNK
    ]
    plan = None
    for chunk in smaller:
        plan = plan_memory(config, prompt_tokens, o, capture_chunk_size=chunk)
        if plan.fits:
            return chunk
    return smaller[-1] if plan is not None and plan.peak < peak else None


def _suggested_ep(config, o: PlanInputs) -> int | None:
    """For an MoE model: the smallest power-of-two expert parallelism (at most the routed experts) above the
    current one at which a rank's expert weights take at most a quarter of the GPU; None without experts."""
    routed = getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0) or 0
    if routed <= 1 or o.ep_size >= routed:
        return None
    budget = o.gpu_memory_gib * GiB / 4
    ep = o.ep_size * 2
    while ep < routed and count_parameters(config, ep)[1] * o.dtype_bytes > budget:
        ep *= 2
    return min(ep, routed)


def _levers(config, prompt_tokens: int, o: PlanInputs, peak: int) -> list[Lever]:
    """The changes :func:`suggest_changes` tries, besides ``--cp`` and ``--prompt``."""
    levers: list[Lever] = []
    if not o.replay_checkpoint_layers:
        levers.append((["--checkpoint-layers"], {"replay_checkpoint_layers": True}))
    if not o.lora_rank:
        levers.append((["--lora-rank", str(SUGGESTED_LORA_RANK)], {"lora_rank": SUGGESTED_LORA_RANK}))
    ep = _suggested_ep(config, o)
    if ep:
        levers.append((["--ep", str(ep)], {"ep_size": ep}))
    if o.offload_prompt_state is None:
        levers.append((["--offload", "cpu"], {"offload_prompt_state": "cpu"}))
    chunk = _suggested_chunk(config, prompt_tokens, o, peak)
    if chunk:
        levers.append((["--chunk-size", str(chunk)], {"capture_chunk_size": chunk}))
    return levers


def _with_cp_or_prompt(
    config, prompt_tokens: int, o: PlanInputs, lever: Lever, parts: list, vary_prompt: bool
) -> tuple[list[Suggestion], tuple[int | None, int]]:
    """A lever set that does not fit alone, with the smallest ``--cp`` that fits it and the largest ``--prompt``,
    each kept only where it needs fewer ranks or allows a longer prompt than its parts (``parts``: their ``(cp,
    prompt)``) do. Returns the suggestions and this set's ``(cp, prompt)``."""
    args, options = lever
    out = []
    cp, at_cp = _smallest_cp(config, prompt_tokens, o) or (None, None)
    if cp and all(c is None or cp < c for c, _ in parts):
        out.append(Suggestion.of(args + ["--cp", str(cp)], {**options, "cp_size": cp}, prompt_tokens, at_cp))
    p = largest_prompt(config, o) if vary_prompt else 0
    if p and all(p > q for _, q in parts):
        out.append(Suggestion.of(args + ["--prompt", str(p)], options, p, plan_memory(config, p, o)))
    return out, (cp, p)


def suggest_changes(
    config, prompt_tokens: int, inputs: PlanInputs | None = None, vary_prompt: bool = True, **options: Any
) -> list[Suggestion]:
    """Changes that make a step fit ``gpu_memory_gib``, each checked by re-running :func:`plan_memory`.

    The levers are ``--checkpoint-layers`` (when off), ``--lora-rank 64`` (when fully fine-tuning), for MoE
    models ``--ep`` (the smallest power of two at which a rank's experts take at most a quarter of the GPU),
    ``--offload cpu`` (the prompt state in pinned host memory: the suggestion says how much), a smaller
    ``--chunk-size`` (:func:`_suggested_chunk`; the full gradient mode's peak follows it), the smallest
    power-of-two ``--cp`` that fits, and the largest ``--prompt`` that fits (:func:`largest_prompt`, left out
    with ``vary_prompt=False``). They are tried alone, then together: a combination is kept only when no part
    of it already fits, and with ``--cp`` or ``--prompt`` only when it needs fewer ranks or allows a longer
    prompt than its parts do.

    Args:
        config: the model config, as for :func:`plan_memory`.
        prompt_tokens: the prompt length P that does not fit.
        inputs: the plan's other inputs, changed by ``options``, as :func:`plan_memory` takes them.
        vary_prompt: also suggest a smaller prompt.

    Returns:
        `list[Suggestion]`: fewest changes first; empty when the plan fits already or nothing tried fits.
    """
    o = PlanInputs.of(inputs, **options)
    as_given = plan_memory(config, prompt_tokens, o)
    if as_given.fits:
        return []
    levers = _levers(config, prompt_tokens, o, as_given.peak)
    out: list[Suggestion] = []
    fits_alone: list[frozenset[int]] = []
    best: dict[frozenset[int], tuple[int | None, int]] = {}  # lever set -> (smallest cp, largest prompt)
    for n in range(len(levers) + 1):
        for combo in itertools.combinations(range(len(levers)), n):
            chosen = frozenset(combo)
            if any(s <= chosen for s in fits_alone):
                continue
            lever = (
                [a for i in combo for a in levers[i][0]],
                {k: v for i in combo for k, v in levers[i][1].items()},
            )
            changed = PlanInputs.of(o, **lever[1])
            if combo:
                plan = plan_memory(config, prompt_tokens, changed)
                if plan.fits:
                    out.append(Suggestion.of(*lever, prompt_tokens, plan))
                    fits_alone.append(chosen)
                    continue
            parts = [v for s, v in best.items() if s < chosen]
            found, best[chosen] = _with_cp_or_prompt(
                config, prompt_tokens, changed, lever, parts, vary_prompt
            )
            out += found
    return out
