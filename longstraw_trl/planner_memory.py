"""Memory planner: will a LongStraw run fit, and where do the bytes go (per rank)?

The budget is computed, not guessed, from the model config: parameters are counted on the meta device
(exact), the prompt state from its per-token and per-layer formulas (exact, as ``PromptState.nbytes``),
and the transient terms (one response's autograd graph, chunked logits, the capture chunk's activations)
from the tensors the engine keeps, per token: each family's patch gives its layers' (``FamilyPatch.planned_*``).
``tests/test_planner.py`` checks the prediction against peaks measured on the H200 (``bench/results/engine_*.json``).

:func:`plan_memory` is a driver over the step's parts: the parameters and optimizer states (with FSDP2's shards),
the capture, the replay, the full gradient (or the prefix-sharing boundaries) and offload.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import UnsupportedModelError
from .kernels.logprob.chunked import LOGITS_CHUNK_ELEMENTS
from .model_patches import FamilyPatch, patch_for_model_type, supported_model_types
from .model_patches.planned_bytes import attention_head_dim
from .planner_inputs import DEFAULT_HOST_MEMORY_GIB, DEFAULT_RANKS_PER_HOST, GiB, PlanInputs
from .planner_terms import (
    count_parameters,
    fixed_state_bytes,
    fsdp_groups,
    fsdp_shard_elements,
    full_gradient_bytes,
    kept_page_parts_bytes,
    lora_parameters,
    offload_bytes,
    planned_layer_types,
    shared_prefix_boundary_bytes,
    state_bytes,
)

# The planner's formulas cover these too, but the engine has no patch for them (see presets.py).
PLANNER_ONLY_MODEL_TYPES: tuple[str, ...] = ()


@dataclass
class MemoryPlan:
    """Per-rank bytes of one LongStraw GRPO step (see :func:`plan_memory`)."""

    weights: int
    gradients: int
    optimizer: int
    state_by_kind: dict[str, int]
    response_graph: int
    logits: int
    capture_workspace: int
    gpu_bytes: int
    params: int = 0
    trainable_params: int = 0
    #: ``gradient_mode="full"``: fp32 dK/dV buffers of the pages plus the GDN leaf gradients (the state's size)
    gradient_buffers: int = 0
    #: ``gradient_mode="full"`` or ``prefix_sharing="all"``: the fixed-size states kept at every capture-chunk boundary
    kept_boundaries: int = 0
    #: ``gradient_mode="full"``: one layer's pages' dK/dV in fp32 while a replay's backward computes them
    page_grad_workspace: int = 0
    #: ``gradient_mode="full"``: the prompt backward's segment (one capture chunk) recomputed under autograd: its
    #: graph (with layer checkpointing: every layer's input, plus one layer's graph) and the K/V it hands back with
    #: their fp32 gradients
    prompt_backward_graph: int = 0
    #: ``gradient_mode="full"`` with layer checkpointing: every attention layer's page attention over the segment
    #: (fp32 out and LSE), kept from its first forward for its recompute, which then does not attend to the pages again
    prompt_backward_page_parts: int = 0
    #: ``offload_prompt_state="cpu"``: the part of the state kept in pinned host memory (the rest stays on the device)
    host_state: int = 0
    #: ``offload_prompt_state="cpu"``: device bytes the running layer holds of its streamed-back state (the largest
    #: layer's)
    offload_workspace: int = 0
    #: FSDP2 (``fsdp_size >= 1``): the gathered parameters a rank holds besides its shard: the root module's (embedding,
    #: final norm, head: FSDP2 keeps the root gathered from forward to backward) and two decoder layers' (the running
    #: one and the prefetched next)
    fsdp_gathered: int = 0
    #: FSDP2: what of :attr:`fsdp_gathered` the capture holds at its peak: the two decoder layers (the embedding is
    #: freed after its forward, before the layers run, and the capture does not run the head; the 27B at world size 1
    #: peaked 0.4 GiB over the unwrapped model's capture on an H100)
    fsdp_gathered_in_capture: int = 0
    #: FSDP2: the unsharded gradients the replays accumulate under ``no_sync`` (no reduce-scatter per response) until
    #: the optimizer step's last backward reduce-scatters them into the sharded :attr:`gradients`
    fsdp_unsharded_gradients: int = 0
    #: ``gradient_mode="full"`` with ``offload_prompt_state="cpu"``: the part of :attr:`gradient_buffers` in host
    #: memory (the offloaded pages' dK/dV buffers live beside the pages)
    host_gradient_buffers: int = 0
    #: ``gradient_mode="full"`` with ``offload_prompt_state="cpu"``: the part of :attr:`kept_boundaries` in host
    #: memory (all of it: the kept states wait there until their segment is recomputed)
    host_kept_boundaries: int = 0
    #: host memory this rank may pin for :attr:`host_bytes` (its share of the host's)
    host_memory: int = int(DEFAULT_HOST_MEMORY_GIB / DEFAULT_RANKS_PER_HOST * GiB)
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> int:
        """The whole prompt state on this rank, on the device or in host memory."""
        return sum(self.state_by_kind.values())

    @property
    def device_state(self) -> int:
        """The prompt state the device holds: all of it, less what ``offload_prompt_state="cpu"`` keeps on the host."""
        return self.state - self.host_state

    @property
    def host_bytes(self) -> int:
        """Host memory of this rank: the offloaded state and, in full mode, its gradient buffers and the kept
        boundary states."""
        return self.host_state + self.host_gradient_buffers + self.host_kept_boundaries

    @property
    def host_pinned_bytes(self) -> int:
        """What of :attr:`host_bytes` is pinned: the offloaded state and the kept boundary states. The full mode's
        dK/dV buffers are pageable host memory (a segment takes its tokens' part back with a synchronous copy)."""
        return self.host_state + self.host_kept_boundaries

    @property
    def device_full_gradient(self) -> int:
        """The full gradient's buffers and kept boundary states that the device holds (all of them without
        offload)."""
        return (
            self.gradient_buffers
            - self.host_gradient_buffers
            + self.kept_boundaries
            - self.host_kept_boundaries
        )

    @property
    def capture_peak(self) -> int:
        """Peak while capturing: weights, optimizer states, the state, one chunk's activations (gradients
        are freed by ``zero_grad(set_to_none=True)`` before the next step's capture)."""
        return (
            self.weights
            + self.fsdp_gathered_in_capture
            + self.optimizer
            + self.device_state
            + self.offload_workspace
            + self.capture_workspace
        )

    @property
    def replay_peak(self) -> int:
        """Peak while replaying one response under autograd (the step's high-water mark)."""
        return (
            self.weights
            + self.fsdp_gathered
            + self.gradients
            + self.fsdp_unsharded_gradients
            + self.optimizer
            + self.device_state
            + self.offload_workspace
            + self.response_graph
            + self.logits
            + self.device_full_gradient
            + self.page_grad_workspace
        )

    @property
    def prompt_backward_peak(self) -> int:
        """Peak while the full gradient's prompt backward recomputes a segment (0 in response-only mode)."""
        if not self.prompt_backward_graph:
            return 0
        return (
            self.weights
            + self.fsdp_gathered
            + self.gradients
            + self.fsdp_unsharded_gradients
            + self.optimizer
            + self.device_state
            + self.offload_workspace
            + self.device_full_gradient
            + self.prompt_backward_graph
            + self.prompt_backward_page_parts
        )

    @property
    def peak(self) -> int:
        return max(self.capture_peak, self.replay_peak, self.prompt_backward_peak)

    @property
    def fits_gpu(self) -> bool:
        return self.peak <= self.gpu_bytes

    @property
    def fits_host(self) -> bool:
        """The offloaded state (and its full-gradient buffers) fit the host memory this rank may pin (always,
        without offload)."""
        return self.host_bytes <= self.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            state=self.state,
            device_state=self.device_state,
            capture_peak=self.capture_peak,
            replay_peak=self.replay_peak,
            fits_gpu=self.fits_gpu,
            fits_host=self.fits_host,
            fits=self.fits,
            host_bytes=self.host_bytes,
            host_pinned_bytes=self.host_pinned_bytes,
        )
        return d


def check_plannable(model_type: str | None) -> None:
    """Raise :class:`~longstraw_trl.errors.UnsupportedModelError` unless the planner models ``model_type``.

    The accepted model types are the engine's (``supported_model_types()``) plus
    :data:`PLANNER_ONLY_MODEL_TYPES`; the message lists them.
    """
    supported = supported_model_types()
    if model_type not in supported and model_type not in PLANNER_ONLY_MODEL_TYPES:
        only = PLANNER_ONLY_MODEL_TYPES
        extra = f" (and, for planning only, {', '.join(only)})" if only else ""
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by LongStraw-TRL; supported model types: "
            f"{', '.join(supported)}{extra}"
        )


def plan_memory(config, prompt_tokens: int, inputs: PlanInputs | None = None, **options: Any) -> MemoryPlan:
    """Per-rank memory of a LongStraw GRPO step on ``config`` with a prompt of ``prompt_tokens``.

    ``inputs`` (:class:`~longstraw_trl.planner_inputs.PlanInputs`; default: bf16 weights, G = 8, R = 2048, an H200)
    with ``options`` changed, each a field's name or its short name (``response_tokens``, ``checkpoint_layers``,
    ``offload``, ``prefix_sharing``). The parts, in turn: the parameters and optimizer states (FSDP2's shards with
    ``fsdp_size >= 1``; with ``ep_size > 1`` too, the routed experts stay out of FSDP2, this rank's 1/``ep_size`` of
    them whole), the prompt state, the replay (the graph of the responses replayed together while responses x R stays
    within ``replay_batch_tokens``, and the head's logits), the capture chunk, the full gradient
    (:func:`~longstraw_trl.planner_terms.full_gradient_bytes` and the prompt backward's segment) or the prefix-sharing
    boundaries (:func:`~longstraw_trl.planner_terms.shared_prefix_boundary_bytes`), and offload (the offloadable state
    in :attr:`MemoryPlan.host_state` and the running layer's streamed-back bytes in both peaks; it fits only within
    ``host_memory_gib``, this rank's share of the host's memory). Raises
    :class:`~longstraw_trl.errors.UnsupportedModelError` for a model type it does not model and
    :class:`~longstraw_trl.errors.LongStrawError` for an option it does not know.
    """
    check_plannable(getattr(config, "model_type", None))
    o = PlanInputs.of(inputs, **options)
    patch = patch_for_model_type(config.model_type)
    plan = MemoryPlan(
        **_parameter_terms(config, o),
        state_by_kind=state_bytes(config, prompt_tokens, o.cp_size, o.page_size, o.dtype_bytes),
        **_replay_terms(config, patch, o),
        capture_workspace=patch.planned_capture_bytes(config, o.capture_chunk_size, o.dtype_bytes),
        gpu_bytes=int(o.gpu_memory_gib * GiB),
        host_memory=int(o.host_memory_gib * GiB),
    )
    if o.fsdp_size >= 1:
        plan.notes.append(_fsdp_note(o.fsdp_size))
    if o.gradient_mode.full:
        _add_full_gradient(plan, config, patch, prompt_tokens, o)
    elif o.prompt_prefix_sharing.cached_branches:  # the full mode keeps the same states already
        _add_prefix_boundaries(plan, config, prompt_tokens, o)
    if o.prompt_prefix_sharing.batch_trunks:
        _note_trunks(plan, config, prompt_tokens, o)
    if o.offload_prompt_state == "cpu":
        _add_offload(plan, config, prompt_tokens, o)
    plan.notes += _closing_notes(config, o)
    return plan


def _optimizer_bytes(o: PlanInputs, trainable: int) -> int:
    """AdamW's two states per trainable element (``optimizer="none"``: nothing)."""
    return {"adamw": 2 * trainable * o.trained_bytes, "none": 0}[o.optimizer]


def _parameter_terms(config, o: PlanInputs) -> dict[str, int]:
    """The weights, gradients and optimizer states this rank holds (FSDP2's with ``fsdp_size >= 1``)."""
    params, experts, _ = count_parameters(config, o.ep_size)
    trainable = lora_parameters(config, o.lora_rank) if o.lora_rank else params
    counts = dict(params=params, trainable_params=trainable)
    if o.fsdp_size >= 1:
        return {**counts, **_fsdp_terms(config, o, trainable, experts)}
    return dict(
        counts,
        weights=params * o.dtype_bytes + (trainable * o.trained_bytes if o.lora_rank else 0),
        gradients=trainable * o.trained_bytes,
        optimizer=_optimizer_bytes(o, trainable),
    )


def _fsdp_terms(config, o: PlanInputs, trainable: int, experts: int) -> dict[str, int]:
    """FSDP2's shards of the weights, gradients and optimizer states, the gathered root and two decoder layers, and the
    unsharded gradients the replays accumulate under ``no_sync``. With ``ep_size > 1`` the routed experts stay out of
    ``fully_shard``: this rank's 1/``ep_size`` of them, whole."""
    b = o.dtype_bytes
    kept = experts if o.ep_size > 1 else 0
    kept_trainable = 0 if o.lora_rank else kept
    groups = fsdp_groups(config, o.lora_rank, without_experts=o.ep_size > 1)
    every = [entry for entries in groups.values() for entry in entries]
    sharded_trainable = fsdp_shard_elements([shape for shape, trained in every if trained], o.fsdp_size)
    weights = (fsdp_shard_elements([shape for shape, _ in every], o.fsdp_size) + kept) * b
    if o.lora_rank:  # the adapters' shards in their own dtype
        weights += sharded_trainable * (o.trained_bytes - b)
    largest_layer = max(
        sum(math.prod(shape) for shape, _ in entries) for key, entries in groups.items() if key != "root"
    )
    root = sum(math.prod(shape) for shape, _ in groups["root"])
    sharded_trainable += kept_trainable
    return dict(
        weights=weights,
        gradients=sharded_trainable * o.trained_bytes,
        optimizer=_optimizer_bytes(o, sharded_trainable),
        fsdp_gathered=(root + 2 * largest_layer) * b,
        fsdp_gathered_in_capture=2 * largest_layer * b,
        # the unsharded parameters' gradients under no_sync are in their compute dtype (the model's: FSDP2's param_dtype)
        fsdp_unsharded_gradients=(trainable - kept_trainable) * b,
    )


def _stack_graph_bytes(
    config, types: list[str], graphs: dict[str, int], tokens: int, checkpointed: bool, b: int
) -> int:
    """The decoder stack's graph over ``tokens`` from each layer kind's (``graphs``): with layer checkpointing every
    layer's input and the largest layer's graph, else every layer's graph."""
    if checkpointed:
        return len(types) * tokens * config.hidden_size * b + max(graphs[t] for t in set(types))
    return sum(graphs[t] for t in types)


def _replay_terms(config, patch: FamilyPatch, o: PlanInputs) -> dict[str, int]:
    """A replay under autograd: the graph of the responses replayed together (each layer kind's from its family
    patch; checkpointed, with the page parts kept for the recompute), and the head's logits."""
    types = planned_layer_types(config)
    r = o.max_completion_length * o.replayed_together
    graphs = {t: patch.planned_layer_graph_bytes(config, t, r, o.dtype_bytes) for t in set(types)}
    graph = _stack_graph_bytes(config, types, graphs, r, o.replay_checkpoint_layers, o.dtype_bytes)
    if o.replay_checkpoint_layers:
        graph += kept_page_parts_bytes(config, types, r)
    vocab = count_parameters(config, o.ep_size)[2]
    # logits: one fp32 chunk, its log_softmax and gradient; with full fine-tuning the head's and the
    # embedding's weight gradients also appear once as a dense temporary before accumulation
    logits = 3 * LOGITS_CHUNK_ELEMENTS * 4 + (0 if o.lora_rank else vocab * o.dtype_bytes)
    return dict(response_graph=graph, logits=logits)


def _add_full_gradient(
    plan: MemoryPlan, config, patch: FamilyPatch, prompt_tokens: int, o: PlanInputs
) -> None:
    """``gradient_mode="full"``: the gradient buffers and kept boundary states, and the prompt backward's segment (one
    capture chunk) recomputed under autograd: its graph (each layer kind's from its family patch, at the last segment,
    which has the most resident tokens before it), the K/V it hands back with their fp32 gradients and, checkpointed,
    every attention layer's page parts."""
    (
        plan.gradient_buffers,
        plan.kept_boundaries,
        plan.page_grad_workspace,
        plan.host_gradient_buffers,
        plan.host_kept_boundaries,
    ) = full_gradient_bytes(
        config,
        prompt_tokens,
        o.cp_size,
        o.page_size,
        o.dtype_bytes,
        o.capture_chunk_size,
        o.offload_prompt_state,
    )
    b, types = o.dtype_bytes, planned_layer_types(config)
    segment = min(o.capture_chunk_size, max(prompt_tokens - 1, 1))
    before = max(prompt_tokens - 1 - segment, 0)
    graphs = {t: patch.planned_segment_layer_bytes(config, t, segment, before, b) for t in set(types)}
    checkpointed = o.segment_checkpoint_layers
    kv = config.num_key_value_heads * attention_head_dim(config)
    handed_back = sum(t == "full_attention" for t in types) * segment * 2 * kv * (b + 4)
    plan.prompt_backward_graph = (
        _stack_graph_bytes(config, types, graphs, segment, checkpointed, b) + handed_back
    )
    if checkpointed:
        plan.prompt_backward_page_parts = kept_page_parts_bytes(config, types, segment)
    plan.notes.append(
        "gradient_mode='full': dK/dV buffers, kept GDN / window boundary states, one layer's dK/dV"
    )


def _add_prefix_boundaries(plan: MemoryPlan, config, prompt_tokens: int, o: PlanInputs) -> None:
    """``prompt_prefix_sharing="all"``: the fixed-size layer states kept at every capture-chunk boundary."""
    plan.kept_boundaries = shared_prefix_boundary_bytes(
        config, prompt_tokens, o.dtype_bytes, o.capture_chunk_size
    )
    plan.notes.append(
        "prompt_prefix_sharing='all': fixed-size layer states kept at every capture-chunk boundary"
    )


def _note_trunks(plan: MemoryPlan, config, prompt_tokens: int, o: PlanInputs) -> None:
    """``prompt_prefix_sharing`` ``"batch"`` / ``"all"``: a trunk of the batch's prompt trie holds one prompt's
    fixed-size layer states of its own (its K/V pages are the branches' prefix views); not counted."""
    fixed = fixed_state_bytes(config, prompt_tokens, o.dtype_bytes)
    if fixed:
        plan.notes.append(
            f"prompt_prefix_sharing={o.prompt_prefix_sharing.value!r}: each trunk shared by a batch's prompts "
            f"holds up to {fixed / 2**20:.0f} MiB of GDN / window states of its own (not counted)"
        )


def _add_offload(plan: MemoryPlan, config, prompt_tokens: int, o: PlanInputs) -> None:
    """``offload_prompt_state="cpu"``: the offloadable state in host memory, the running layer's streamed back."""
    plan.host_state, plan.offload_workspace, kept = offload_bytes(
        config, prompt_tokens, o.cp_size, o.page_size, o.dtype_bytes, o.device_state_bytes
    )
    plan.notes.append(
        f"offload='cpu': {plan.host_state / GiB:.2f} GiB of prompt state in pinned host memory on this rank "
        f"(of the {plan.host_memory / GiB:.2f} GiB it may pin), streamed back a layer at a time"
        + (f"; {kept / GiB:.2f} GiB of whole layers kept on the device (device_state_bytes)" if kept else "")
    )


def _fsdp_note(fsdp_size: int) -> str:
    return (
        (
            f"FSDP2 over {fsdp_size} ranks: weights, gradients and optimizer states are this rank's shards"
            if fsdp_size > 1
            else "FSDP2 on one rank: the shards are the whole parameters, so the gathered copies and the "
            "unsharded gradients are all overhead over the unwrapped model"
        )
        + "; the replays accumulate unsharded gradients under no_sync until the step's last backward "
        "reduce-scatters them; Accelerate's mixed precision keeps fp32 masters of the trainable parameters "
        "(full fine-tuning: about 2x the shard, gradient and optimizer lines)"
    )


def _closing_notes(config, o: PlanInputs) -> list[str]:
    """The notes after the terms': expert parallelism, FSDP2's generation, the responses replayed together."""
    notes = []
    experts = count_parameters(config, o.ep_size)[1]
    if experts and o.ep_size > 1:
        notes.append(
            f"experts sharded over {o.ep_size} EP ranks"
            + (" and left out of FSDP2 (not sharded further)" if o.fsdp_size >= 1 else "")
        )
    if o.fsdp_size >= 1:
        # measured: the 27B at 512K on an H100 peaked at 73.4 GiB in its generation against 62.1 planned
        notes.append(
            "FSDP2: the generation keeps units gathered in what the GPU still has free (generation_fsdp_gather_gib; "
            "default: all but 2 GiB and 5% of the card), so the card may show more than these peaks while it "
            "decodes; set generation_fsdp_gather_gib to bound it"
        )
    notes.append(
        f"G={o.num_generations}: {o.replayed_together} response(s) replayed together under autograd "
        f"(replay_batch_tokens={o.replay_batch_tokens}); the peak does not grow with G beyond that"
    )
    return notes


def largest_prompt(
    config, inputs: PlanInputs | None = None, limit_tokens: int = 1 << 34, **options: Any
) -> int:
    """The largest prompt (a whole number of pages) whose step fits ``gpu_memory_gib``; 0 if none does.

    ``inputs`` and ``options`` as :func:`plan_memory` takes them. The peak grows with P, so this bisects.
    """
    o = PlanInputs.of(inputs, **options)

    def fits(pages: int) -> bool:
        return plan_memory(config, pages * o.page_size, o).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * o.page_size > limit_tokens:
            return lo * o.page_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * o.page_size
