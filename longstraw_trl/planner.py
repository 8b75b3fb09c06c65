"""Memory planner: will a LongStraw run fit, and where do the bytes go (per rank)?

The budget is computed, not guessed, from the model config: parameters are counted on the meta device
(exact), the prompt state from its per-token and per-layer formulas (exact, as ``PromptState.nbytes``),
and the transient terms (one response's autograd graph, chunked logits, the capture chunk's activations)
from the tensors the engine keeps, per token. ``tests/test_planner.py`` checks the prediction against
peaks measured on the H200 (``bench/results/engine_*.json``).
"""

from __future__ import annotations

import itertools
import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from longstraw_trl.errors import LongStrawError, UnsupportedModelError
from longstraw_trl.kernels.logprob.chunked import LOGITS_CHUNK_ELEMENTS
from longstraw_trl.kernels.sparse_attention.dsa import ATTENTION_QUERY_ROWS
from longstraw_trl.layer_state import owned_tokens
from longstraw_trl.model_patches import patch_for_model_type, supported_model_types

GiB = 2**30

GPU_MEMORY_GIB = {"h200": 139.8, "h100": 79.1, "h20": 95.0, "a100-80g": 79.1, "a100-40g": 39.4}

# Host memory a rank may pin for an offloaded prompt state (``offload="cpu"``), by default: a DGX H200 / H100 host's
# 2 TiB shared by its 8 GPUs (``longstraw plan --host-memory GiB --ranks-per-host N``).
DEFAULT_HOST_MEMORY_GIB = 2048.0
DEFAULT_RANKS_PER_HOST = 8

# The planner's formulas cover these too, but the engine has no patch for them (see presets.py).
PLANNER_ONLY_MODEL_TYPES: tuple[str, ...] = ()

# The LoRA rank a plan that does not fit is re-planned with (a common default, not a recommendation).
SUGGESTED_LORA_RANK = 64
# the smallest capture chunk a suggestion names: below it a chunk's GEMMs stop filling the GPU
SMALLEST_SUGGESTED_CHUNK = 1024


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
    #: ``gradient_mode="full"`` or ``prefix_sharing``: the fixed-size states kept at every capture-chunk boundary
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
    #: ``offload="cpu"``: the part of the state kept in pinned host memory (the rest stays on the device)
    host_state: int = 0
    #: ``offload="cpu"``: device bytes the running layer holds of its streamed-back state (the largest layer's)
    offload_workspace: int = 0
    #: FSDP2 (``fsdp_size >= 1``): the gathered parameters a rank holds besides its shard: the root module's (embedding,
    #: final norm, head: FSDP2 keeps the root gathered from forward to backward) and two decoder layers' (the running
    #: one and the prefetched next)
    fsdp_gathered: int = 0
    #: FSDP2: what of :attr:`fsdp_gathered` the capture holds at its peak: the two decoder layers (the embedding is
    #: freed after its forward, before the layers run, and the capture does not run the head; the 27B at world size 1
    #: peaked 0.4 GiB over the unwrapped model's capture on an H100, session 17)
    fsdp_gathered_in_capture: int = 0
    #: FSDP2: the unsharded gradients the replays accumulate under ``no_sync`` (no reduce-scatter per response) until
    #: the optimizer step's last backward reduce-scatters them into the sharded :attr:`gradients`
    fsdp_unsharded_gradients: int = 0
    #: ``gradient_mode="full"`` with ``offload="cpu"``: the part of :attr:`gradient_buffers` in host memory (the
    #: offloaded pages' dK/dV buffers live beside the pages)
    host_gradient_buffers: int = 0
    #: ``gradient_mode="full"`` with ``offload="cpu"``: the part of :attr:`kept_boundaries` in host memory (all of
    #: it: the kept states wait there until their segment is recomputed)
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
        """The prompt state the device holds: all of it, less what ``offload="cpu"`` keeps on the host."""
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


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[: config.num_hidden_layers]
    return ["full_attention"] * config.num_hidden_layers


# Meta-device builds by config: one takes ~0.2 s for a 27B model, and largest_prompt / suggest_changes
# re-plan the same config dozens of times. Keyed by the full config JSON, so a changed config re-counts.
_META_COUNTS: dict[tuple[str, str, int], tuple[int, int, int, int]] = {}


def _meta_counts(config, ep_size: int) -> tuple[int, int, int, int]:
    key = (type(config).__qualname__, config.to_json_string(use_diff=False), ep_size)
    if key in _META_COUNTS:
        return _META_COUNTS[key]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = experts = vocab = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts." in name or name.endswith(".experts"):
            n //= ep_size
            experts += n
        if "embed_tokens" in name or "lm_head" in name:
            vocab += n
        total += n
    lora_per_rank = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name and ".experts" not in name:
            lora_per_rank += mod.in_features + mod.out_features
    _META_COUNTS[key] = total, experts, vocab, lora_per_rank
    return _META_COUNTS[key]


def count_parameters(config, ep_size: int = 1) -> tuple[int, int, int]:
    """``(all params on this rank, expert params on this rank, embedding+head params)`` via the meta device."""
    return _meta_counts(config, ep_size)[:3]


def fsdp_shard_elements(shapes: list[tuple[int, ...]], fsdp_size: int) -> int:
    """Elements one rank stores of these parameters under FSDP2: each parameter is cut along dim 0 into
    ``fsdp_size`` chunks padded to the largest (``torch.chunk``; FSDP2's padded sharded storage), i.e.
    ``ceil(dim0 / fsdp_size) x the other dims``."""
    total = 0
    for shape in shapes:
        if not shape:  # a scalar parameter: FSDP2 shards it as a 1-element tensor
            shape = (1,)
        rest = math.prod(shape[1:])
        total += -(-shape[0] // fsdp_size) * rest
    return total


def fsdp_groups(
    config, lora_rank: int | None = None, without_experts: bool = False
) -> dict[str, list[tuple[tuple[int, ...], bool]]]:
    """``(shape, trainable)`` of the parameters of each FSDP2 group of ``config``'s model as Accelerate's
    ``TRANSFORMER_BASED_WRAP`` builds them: one group per decoder layer (``"layer.<i>"``), the rest in the root
    (``"root"``). With ``lora_rank`` the model's own parameters are frozen and each non-expert decoder Linear also
    holds its trainable LoRA A ``[r, in]`` and B ``[out, r]``. ``without_experts``: leave out the routed experts
    (``ep_size > 1``: the trainer keeps them out of ``fully_shard``, docs/parallelism.md)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    groups: dict[str, list[tuple[tuple[int, ...], bool]]] = {}
    for name, mod in model.named_modules():
        if without_experts and name.endswith(".experts"):
            continue
        direct = [(tuple(p.shape), not lora_rank) for p in mod.parameters(recurse=False)]
        if (
            lora_rank
            and isinstance(mod, torch.nn.Linear)
            and "lm_head" not in name
            and ".experts" not in name
        ):
            direct += [((lora_rank, mod.in_features), True), ((mod.out_features, lora_rank), True)]
        parts = name.split(".")
        key = "root"
        if "layers" in parts[:-1]:
            i = parts.index("layers")
            if parts[i + 1].isdigit():
                key = f"layer.{parts[i + 1]}"
        groups.setdefault(key, []).extend(direct)
    return groups


def lora_parameters(config, rank: int) -> int:
    """LoRA params on every non-expert Linear of the decoder (attention, GDN and MLP projections)."""
    return rank * _meta_counts(config, 1)[3]


def _state_types(config) -> list[tuple[int, type]]:
    """``(layer, LayerState class)`` of every layer that keeps a prompt state (the family's
    ``layer_state_type``; ``None`` for blocks that keep none, e.g. Nemotron-H's MLP and MoE blocks)."""
    patch = patch_for_model_type(config.model_type)
    kinds = ((i, patch.layer_state_type(config, i)) for i in range(len(_layer_types(config))))
    return [(i, cls) for i, cls in kinds if cls is not None]


def state_bytes(config, prompt_tokens: int, cp_size: int = 1, page_size: int = 16384, dtype_bytes: int = 2):
    """Per-rank prompt state by kind: each layer's ``LayerState.planned_bytes`` (the class its family patch
    keeps there), for the ``P - 1`` resident tokens on the rank holding the most pages (rank 0)."""
    resident = max(prompt_tokens - 1, 0)
    on_rank = owned_tokens(0, resident, page_size, 0, cp_size)
    out: dict[str, int] = {}
    for i, cls in _state_types(config):
        tokens = on_rank if cls.sharded else resident
        for kind, n in cls.planned_bytes_by_kind(config, i, tokens, dtype_bytes).items():
            out[kind] = out.get(kind, 0) + n
    return out


def offload_bytes(
    config, prompt_tokens: int, cp_size: int = 1, page_size: int = 16384, dtype_bytes: int = 2
) -> tuple[int, int]:
    """``(host bytes, device workspace)`` per rank with ``offload="cpu"``: the state of every offloadable layer
    kind (``LayerState.offloadable``: K/V pages, MLA latent and indexer keys; GDN and window states stay on the
    device) in host memory, and the most that one running layer streams back
    (``LayerState.planned_offload_workspace``)."""
    resident = max(prompt_tokens - 1, 0)
    on_rank = owned_tokens(0, resident, page_size, 0, cp_size)
    host = workspace = 0
    for i, cls in _state_types(config):
        if cls.offloadable:
            tokens = on_rank if cls.sharded else resident
            host += cls.planned_bytes(config, i, tokens, dtype_bytes)
            workspace = max(
                workspace, cls.planned_offload_workspace(config, i, tokens, page_size, dtype_bytes)
            )
    return host, workspace


def kept_page_parts_bytes(config, types: list[str], tokens: int) -> int:
    """Bytes a checkpointed call over ``tokens`` queries keeps from each attention layer's first forward for its
    recompute (``context.ForwardContext._prompt_part``): the queries' attention over the prompt pages, fp32 out and LSE,
    ``[Hq, tokens, d + 1]`` a layer. Sliding-window layers keep none (their window is recomputed)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_layers = sum(t == "full_attention" for t in types)
    return attention_layers * tokens * config.num_attention_heads * (head_dim + 1) * 4


def full_gradient_bytes(
    config,
    prompt_tokens: int,
    cp_size: int = 1,
    page_size: int = 16384,
    dtype_bytes: int = 2,
    chunk_size: int = 8192,
    offload: str | None = None,
) -> tuple[int, int, int, int, int]:
    """``(gradient buffers, kept boundary states, page-gradient workspace, host gradient buffers, host kept
    boundary states)`` per rank for ``gradient_mode="full"``: a ``"buffer"`` kind (K/V pages) accumulates fp32
    dK/dV of its own size (beside its pages: in host memory when ``offload="cpu"`` offloads the kind), and one
    layer's dK/dV are computed in fp32 on the device at a time; a ``"leaf"`` kind (GDN) keeps a gradient of its
    size on the device and a copy of the state at every capture-chunk boundary (in host memory with
    ``offload="cpu"``). The first two include the host parts. Raises :class:`~longstraw_trl.errors.UnsupportedModelError` for a layer kind without a full gradient."""
    resident = max(prompt_tokens - 1, 0)
    on_rank = owned_tokens(0, resident, page_size, 0, cp_size)
    boundaries = max(-(-resident // chunk_size) - 1, 0)
    buffers = kept = workspace = host_buffers = 0
    for i, cls in _state_types(config):
        n = cls.planned_bytes(config, i, on_rank if cls.sharded else resident, dtype_bytes)
        if cls.grad_kind == "buffer":
            fp32 = cls.planned_grad_bytes(config, i, on_rank if cls.sharded else resident, dtype_bytes)
            buffers += fp32
            workspace = max(workspace, fp32)
            if offload == "cpu" and cls.offloadable:
                host_buffers += fp32
        elif cls.grad_kind == "leaf":
            buffers += n
            kept += boundaries * n
        else:
            raise UnsupportedModelError(
                f"gradient_mode='full' has no full gradient for the {cls.__name__} of layer {i} ({config.model_type})"
            )
    return buffers, kept, workspace, host_buffers, kept if offload == "cpu" else 0


def shared_prefix_boundary_bytes(
    config, prompt_tokens: int, dtype_bytes: int = 2, chunk_size: int = 8192
) -> int:
    """``prompt_prefix_sharing=True``: the fixed-size layer states (GDN, sliding windows) a policy capture keeps at
    every capture-chunk boundary, where a later prompt may branch off (growing kinds give a prefix view instead)."""
    resident = max(prompt_tokens - 1, 0)
    boundaries = max(-(-resident // chunk_size) - 1, 0)
    fixed = 0
    for i, cls in _state_types(config):
        if not cls.sharded:
            fixed += cls.planned_bytes(config, i, resident, dtype_bytes)
    return boundaries * fixed


def _layer_graph_bytes(config, kind: str, tokens: int, b: int) -> int:
    """Tensors autograd keeps for one decoder layer over ``tokens`` response tokens."""
    if getattr(config, "layers_block_type", None) is not None:  # Nemotron-H: one mixer a block
        return tokens * _nemotron_h_block_bytes(config, kind, b)
    h = config.hidden_size
    # routed experts: `num_experts` (Qwen MoE) or `n_routed_experts` (GLM: glm4_moe, glm_moe_dsa)
    routed = getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)
    inter = getattr(config, "moe_intermediate_size", None) if routed else None
    inter = (inter or config.intermediate_size) * max(1, getattr(config, "num_experts_per_tok", 1) or 1)
    mlp = (2 * h + 3 * inter) * b  # norm in/out, gate, up, act(gate)*up
    if kind == "linear_attention":
        hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        # projections + conv in/out + gate z + norm; the chunked delta rule keeps ~6x its fp32 inputs
        # (q and k repeated to the value heads) and one [Hv, K, V] fp32 state per 64-token chunk
        rule = 6 * (2 * hv * dk + hv * dv) * 4 + hv * dk * dv * 4 // 64
        mixer = (2 * h + 3 * conv_dim + 3 * hv * dv) * b + rule
    else:
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        gate = q if "qwen3_5" in config.model_type or "qwen3_next" in config.model_type else 0
        # norm in/out, projections (+ q/k norm and rope copies), output, the fp32 merged out kept for backward
        mixer = (2 * h + 3 * (q + 2 * kv) + 2 * q + 2 * gate) * b + q * 4
    return tokens * (mixer + mlp)


def _is_mla_dsa(config) -> bool:
    """Whether ``config``'s attention is MLA with a DSA indexer (GLM-5, DeepSeek-V3.2)."""
    return bool(getattr(config, "index_topk", None) and getattr(config, "kv_lora_rank", None))


def _mla_dsa_capture_bytes(config, chunk: int) -> int:
    """A capture chunk's transient through an MLA + DSA layer (GLM-5, DeepSeek-V3.2), at its peak: the merge of the
    attention over the selected prompt rows with the chunk's own (``kernels/attention.merge_partials``), where five fp32
    ``[H, chunk, kv_lora]`` tensors are alive (both parts, both weighted terms, the merged output), beside the absorbed
    query ``[H, chunk, kv_lora + rope]``, the q / q_lora / indexer-query projections, three hidden-size activations,
    this and the previous layer's int64 selections, and the absorbed ``kv_b_proj`` weights. Itemised on the CPU with
    every tensor's lifetime tracked (session 19) and within 0.6% of the 13.52 GiB the GLM-5 slice's train() step
    added over its weights and state on an H100 at a 16K chunk (``tests/test_planner.py``)."""
    heads, lat = config.num_attention_heads, config.kv_lora_rank
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    per_token = (
        20 * heads * lat
        + 2 * heads * (lat + nope + 3 * rope)
        + 2 * (config.q_lora_rank + config.index_n_heads * config.index_head_dim)
        + 6 * config.hidden_size
        + 32 * config.index_topk
        + 4096
    )
    return chunk * per_token + 2 * lat * heads * (nope + config.v_head_dim)


def _mla_dsa_backward_bytes(config, segment: int, resident: int, b: int) -> int:
    """What an MLA + DSA layer holds at the peak of its backward over a ``segment`` of prompt tokens after
    ``resident`` ones (the full gradient's prompt backward): per token the absorbed query ``[H, kv_lora + rope]`` and
    the projected ``q``, both parts' selections (int64 top-k each), both parts' fp32 ``[H, kv_lora]`` outputs kept for
    the merge's backward and the gradients of the merged output and of a part, and the part's fp32 dQ; beside them
    one query tile of the selected-keys backward (``kernels/sparse_attention.selected_attention_dq``: its gathered
    rows, five fp32 score-sized tensors and the rows' fp32 gradient with its value-half temporary) and the fp32
    gradient of the whole latent table. Itemised from that code and measured on the CPU at the real widths (session
    21: 4.85 / 5.20 / 5.89 GiB a segment of 512 / 1,024 / 2,048 tokens, 0.68 MiB a token; this term gives 4.84 /
    5.24 / 6.04, 0.77 MiB a token and 4.6 GiB beside, ``tests/test_planner.py``)."""
    heads, lat, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    width, topk = lat + rope, config.index_topk
    per_token = (
        4 * heads * lat * 4  # both parts' outputs (the merge saves them) and two gradients of that size
        + heads * width * (4 + b)  # the part's dQ (fp32) and the absorbed query
        + heads * config.qk_head_dim * b  # q, saved by its split and the absorbing einsum
        + 2 * 8 * topk  # the prompt's and the segment's own selected rows
    )
    rows, keys = ATTENTION_QUERY_ROWS, min(topk, resident + segment)
    tile = rows * keys * (width * (b + 4 + 4) + lat * 4) + 5 * heads * rows * keys * 4
    return segment * per_token + tile + resident * width * 4


def _nemotron_h_block_bytes(config, kind: str, b: int) -> int:
    """Per response token, what autograd keeps for one Nemotron-H block (norm in/out plus its one mixer). An estimate
    from the tensors the mixers keep, not yet checked against a device peak (``tests/test_planner.py`` measures the
    Qwen and GLM families only)."""
    h = config.hidden_size
    if (
        kind == "linear_attention"
    ):  # Mamba-2: in_proj out, conv in/out, gate, gated norm; the SSD scan in fp32
        heads, p, n, g = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups
        inner, conv = heads * p, heads * p + 2 * g * n
        chunk = (
            config.chunk_size
        )  # per token: its row of the chunk's decay and score matrices, x dt, B and C per head
        scan = (2 * heads * chunk + inner + 2 * heads * n + 2 * inner) * 4
        return (2 * h + (inner + conv + heads) + 2 * conv + 3 * inner) * b + scan
    if kind == "full_attention":
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return (2 * h + 3 * (q + 2 * kv) + 2 * q) * b + q * 4
    if kind == "moe":
        inter = config.moe_intermediate_size * config.num_experts_per_tok
        return (2 * h + 3 * inter + 3 * config.moe_shared_expert_intermediate_size) * b
    return (2 * h + 3 * config.intermediate_size) * b  # mlp: up, act(up), down in


def plan_memory(
    config,
    prompt_tokens: int,
    num_generations: int = 8,
    response_tokens: int = 2048,
    cp_size: int = 1,
    ep_size: int = 1,
    lora_rank: int | None = None,
    optimizer: str = "adamw",
    gpu_memory_gib: float = GPU_MEMORY_GIB["h200"],
    capture_chunk_size: int = 16384,
    page_size: int = 16384,
    dtype_bytes: int = 2,
    checkpoint_layers: bool = False,
    replay_batch_tokens: int = 8192,
    gradient_mode: str = "response_only",
    offload: str | None = None,
    host_memory_gib: float = DEFAULT_HOST_MEMORY_GIB / DEFAULT_RANKS_PER_HOST,
    prefix_sharing: bool = False,
    fsdp_size: int = 0,
    prompt_backward_checkpoint_layers: bool | None = None,
    adapter_dtype_bytes: int | None = None,
) -> MemoryPlan:
    """Per-rank memory of a LongStraw GRPO step on ``config`` (bf16 weights by default).

    The responses of a group are replayed together while responses x ``response_tokens`` stays within
    ``replay_batch_tokens`` (the trainer's option; 0: one at a time), so the autograd graph spans that many
    responses. ``gradient_mode="full"`` adds :func:`full_gradient_bytes` to the replay peak. ``optimizer``: ``"adamw"`` (two states per trainable parameter, in the parameter dtype) or
    ``"none"`` (e.g. a benchmark that only runs backward). ``prefix_sharing`` (the trainer's
    ``prompt_prefix_sharing``) adds :func:`shared_prefix_boundary_bytes` as kept boundaries. ``offload="cpu"`` (the trainer's
    ``offload_prompt_state``) moves the offloadable state to :attr:`MemoryPlan.host_state` and adds the running
    layer's streamed-back bytes (:func:`offload_bytes`) to both peaks; it fits only if that host state is at most
    ``host_memory_gib`` (this rank's share of the host's memory: a 2 TiB host with 8 GPUs by default).
    ``prompt_backward_checkpoint_layers`` (the trainer's option; ``None``: as ``checkpoint_layers``): whether the
    full gradient's recomputed chunk checkpoints its layers (their inputs and one layer's graph) or keeps every
    layer's graph over the chunk.
    ``adapter_dtype_bytes``: bytes a LoRA parameter takes, and its gradient and each AdamW state (``None``: 4, PEFT's
    fp32 adapters, ``autocast_adapter_dtype=True``; 2 for adapters kept in bf16).
    ``fsdp_size``: the policy sharded with FSDP2 over that many ranks (0: not wrapped; 1: FSDP2 on one GPU, whose shards
    are the whole parameters and whose gathered copies are all overhead; weights, gradients and optimizer states by
    :func:`fsdp_shard_elements`; plus :attr:`MemoryPlan.fsdp_gathered` and, since the replays accumulate under
    ``no_sync``, :attr:`MemoryPlan.fsdp_unsharded_gradients`); with ``ep_size > 1`` too, the routed experts are left
    out of FSDP2 (this rank's 1/``ep_size`` of them whole, their gradients and states too). Raises
    :class:`~longstraw_trl.errors.UnsupportedModelError` for a model type it does not model.
    """
    check_plannable(getattr(config, "model_type", None))
    params, experts, vocab = count_parameters(config, ep_size)
    trainable = lora_parameters(config, lora_rank) if lora_rank else params
    # PEFT keeps the adapters of a bf16 / fp16 model in fp32 (its autocast_adapter_dtype, on by default): they, their
    # gradients and AdamW's states take 4 bytes a parameter; without LoRA the trained weights are the model's dtype
    trained_bytes = (adapter_dtype_bytes or max(dtype_bytes, 4)) if lora_rank else dtype_bytes
    weights = params * dtype_bytes + (trainable * trained_bytes if lora_rank else 0)
    gradients = trainable * trained_bytes
    optimizer_bytes = {"adamw": 2 * trainable * trained_bytes, "none": 0}[optimizer]
    fsdp_gathered = fsdp_gathered_in_capture = fsdp_unsharded_gradients = 0
    if fsdp_size < 0:
        raise LongStrawError(f"fsdp_size must be >= 0 (0: not wrapped), got {fsdp_size}")
    if fsdp_size >= 1:
        # with ep_size > 1 the routed experts stay out of fully_shard: this rank's 1/ep_size of them, whole
        kept = experts if ep_size > 1 else 0
        kept_trainable = 0 if lora_rank else kept
        groups = fsdp_groups(config, lora_rank, without_experts=ep_size > 1)
        every = [entry for entries in groups.values() for entry in entries]
        sharded_trainable = fsdp_shard_elements([shape for shape, trainable in every if trainable], fsdp_size)
        weights = (fsdp_shard_elements([shape for shape, _ in every], fsdp_size) + kept) * dtype_bytes
        if lora_rank:  # the adapters' shards in their own dtype
            weights += sharded_trainable * (trained_bytes - dtype_bytes)
        largest_layer = max(
            sum(math.prod(shape) for shape, _ in entries) for key, entries in groups.items() if key != "root"
        )
        root = sum(math.prod(shape) for shape, _ in groups["root"])
        fsdp_gathered = (root + 2 * largest_layer) * dtype_bytes
        fsdp_gathered_in_capture = 2 * largest_layer * dtype_bytes
        # the unsharded parameters' gradients under no_sync are in their compute dtype (the model's: FSDP2's param_dtype)
        fsdp_unsharded_gradients = (trainable - kept_trainable) * dtype_bytes
        sharded_trainable += kept_trainable
        gradients = sharded_trainable * trained_bytes
        optimizer_bytes = {"adamw": 2 * sharded_trainable * trained_bytes, "none": 0}[optimizer]
    types = _layer_types(config)
    together = max(1, min(num_generations, replay_batch_tokens // max(response_tokens, 1)))
    r = response_tokens * together
    if checkpoint_layers:
        graph = len(types) * r * config.hidden_size * dtype_bytes + max(
            _layer_graph_bytes(config, t, r, dtype_bytes) for t in set(types)
        )
        graph += kept_page_parts_bytes(config, types, r)
    else:
        graph = sum(_layer_graph_bytes(config, t, r, dtype_bytes) for t in types)
    # logits: one fp32 chunk, its log_softmax and gradient; with full fine-tuning the head's and the
    # embedding's weight gradients also appear once as a dense temporary before accumulation
    logits = 3 * LOGITS_CHUNK_ELEMENTS * 4 + (0 if lora_rank else vocab * dtype_bytes)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    chunk = capture_chunk_size
    # MoE-only configs (qwen3_5_moe) have no dense intermediate_size: the routed experts' width, as in the graph
    inter = (
        getattr(config, "intermediate_size", None)
        or config.moe_intermediate_size * config.num_experts_per_tok
    )
    capture_ws = chunk * (
        (2 * config.hidden_size + 3 * inter) * dtype_bytes + 3 * config.num_attention_heads * head_dim * 4
    )
    if _is_mla_dsa(config):
        capture_ws = max(capture_ws, _mla_dsa_capture_bytes(config, chunk))
    plan = MemoryPlan(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer_bytes,
        state_by_kind=state_bytes(config, prompt_tokens, cp_size, page_size, dtype_bytes),
        response_graph=graph,
        logits=logits,
        capture_workspace=capture_ws,
        gpu_bytes=int(gpu_memory_gib * GiB),
        host_memory=int(host_memory_gib * GiB),
        params=params,
        trainable_params=trainable,
        fsdp_gathered=fsdp_gathered,
        fsdp_gathered_in_capture=fsdp_gathered_in_capture,
        fsdp_unsharded_gradients=fsdp_unsharded_gradients,
    )
    if fsdp_size >= 1:
        plan.notes.append(
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
    if gradient_mode == "full":
        (
            plan.gradient_buffers,
            plan.kept_boundaries,
            plan.page_grad_workspace,
            plan.host_gradient_buffers,
            plan.host_kept_boundaries,
        ) = full_gradient_bytes(
            config, prompt_tokens, cp_size, page_size, dtype_bytes, capture_chunk_size, offload
        )
        segment = min(capture_chunk_size, max(prompt_tokens - 1, 1))
        segment_checkpointed = (
            checkpoint_layers
            if prompt_backward_checkpoint_layers is None
            else prompt_backward_checkpoint_layers
        )
        layer_graph = {t: _layer_graph_bytes(config, t, segment, dtype_bytes) for t in set(types)}
        if _is_mla_dsa(config):
            # the MLA + DSA layers' backward (the last segment's: the most resident tokens), or its forward's merge
            mla = max(
                _mla_dsa_backward_bytes(config, segment, max(prompt_tokens - 1 - segment, 0), dtype_bytes),
                _mla_dsa_capture_bytes(config, segment),
            )
            for t in layer_graph:  # GLM-5's "indexed_attention" / "shared_attention", DeepSeek-V3.2's
                layer_graph[t] = max(layer_graph[t], mla)
        if segment_checkpointed:
            segment_graph = len(types) * segment * config.hidden_size * dtype_bytes + max(
                layer_graph[t] for t in set(types)
            )
        else:
            segment_graph = sum(layer_graph[t] for t in types)
        kv = config.num_key_value_heads * head_dim
        attention_layers = sum(t == "full_attention" for t in types)
        handed_back = attention_layers * segment * 2 * kv * (dtype_bytes + 4)
        plan.prompt_backward_graph = segment_graph + handed_back
        if segment_checkpointed:
            plan.prompt_backward_page_parts = kept_page_parts_bytes(config, types, segment)
        plan.notes.append(
            "gradient_mode='full': dK/dV buffers, kept GDN / window boundary states, one layer's dK/dV"
        )
    elif gradient_mode != "response_only":
        raise LongStrawError(f"gradient_mode must be 'response_only' or 'full', got {gradient_mode!r}")
    elif prefix_sharing:  # the full mode keeps the same states already
        plan.kept_boundaries = shared_prefix_boundary_bytes(
            config, prompt_tokens, dtype_bytes, capture_chunk_size
        )
        plan.notes.append(
            "prompt_prefix_sharing: fixed-size layer states kept at every capture-chunk boundary"
        )
    if offload == "cpu":
        plan.host_state, plan.offload_workspace = offload_bytes(
            config, prompt_tokens, cp_size, page_size, dtype_bytes
        )
        plan.notes.append(
            f"offload='cpu': {plan.host_state / GiB:.2f} GiB of prompt state in pinned host memory on this rank "
            f"(of the {plan.host_memory / GiB:.2f} GiB it may pin), streamed back a layer at a time"
        )
    elif offload is not None:
        raise LongStrawError(f"offload must be None or 'cpu', got {offload!r}")
    if experts and ep_size > 1:
        plan.notes.append(
            f"experts sharded over {ep_size} EP ranks"
            + (" and left out of FSDP2 (not sharded further)" if fsdp_size >= 1 else "")
        )
    if fsdp_size >= 1:
        # measured: the 27B at 512K on an H100 peaked at 73.4 GiB in its generation against 62.1 planned (session 18)
        plan.notes.append(
            "FSDP2: the generation keeps units gathered in what the GPU still has free (generation_fsdp_gather_gib; "
            "default: all but 2 GiB and 5% of the card), so the card may show more than these peaks while it "
            "decodes; set generation_fsdp_gather_gib to bound it"
        )
    plan.notes.append(
        f"G={num_generations}: {together} response(s) replayed together under autograd (replay_batch_tokens="
        f"{replay_batch_tokens}); the peak does not grow with G beyond that"
    )
    return plan


def largest_prompt(config, page_size: int = 16384, limit_tokens: int = 1 << 34, **plan_kwargs) -> int:
    """The largest prompt (a whole number of pages) whose step fits ``gpu_memory_gib``; 0 if none does.

    ``plan_kwargs`` are :func:`plan_memory`'s other arguments. The peak grows with P, so this bisects.
    """

    def fits(pages: int) -> bool:
        return plan_memory(config, pages * page_size, page_size=page_size, **plan_kwargs).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * page_size > limit_tokens:
            return lo * page_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * page_size


@dataclass
class Suggestion:
    """A change that makes a plan fit, found by re-planning with it (see :func:`suggest_changes`).

    Args:
        args: the ``longstraw plan`` flags of the change, e.g. ``["--lora-rank", "64", "--cp", "2"]``.
        options: the :func:`plan_memory` keywords it changes (``--prompt`` is ``prompt_tokens`` instead).
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


def _smallest_cp(
    config, prompt_tokens: int, page_size: int, plan_kwargs: dict
) -> tuple[int, MemoryPlan] | None:
    """``(cp_size, its plan)`` for the smallest power of two above the current ``cp_size`` that fits, or None."""
    pages = -(-prompt_tokens // page_size)
    cp = 1
    while cp <= plan_kwargs.get("cp_size", 1):
        cp *= 2
    while True:
        plan = plan_memory(config, prompt_tokens, page_size=page_size, **{**plan_kwargs, "cp_size": cp})
        if plan.fits:
            return cp, plan
        if cp >= pages:  # every rank already holds a single page: more ranks save nothing
            return None
        cp *= 2


def _suggested_chunk(config, prompt_tokens: int, page_size: int, plan_kwargs: dict, peak: int) -> int | None:
    """The largest power-of-two fraction of the capture chunk (down to :data:`SMALLEST_SUGGESTED_CHUNK`) at which
    the plan fits, else the smallest one where it lowers the plan's ``peak`` (for combinations); ``None`` where a
    smaller chunk does not lower it. The chunk sets the capture's activations and, in the full gradient mode, the
    prompt backward's graph, kept page parts and chunk recompute, which dominate that mode's peak."""
    current = plan_kwargs.get("capture_chunk_size", 16384)
    smaller = [
        current >> k for k in range(1, current.bit_length()) if current >> k >= SMALLEST_SUGGESTED_CHUNK
    ]
    plan = None
    for chunk in smaller:
        plan = plan_memory(
            config, prompt_tokens, page_size=page_size, **{**plan_kwargs, "capture_chunk_size": chunk}
        )
        if plan.fits:
            return chunk
    return smaller[-1] if plan is not None and plan.peak < peak else None


def _suggested_ep(config, plan_kwargs: dict) -> int | None:
    """For an MoE model: the smallest power-of-two expert parallelism (at most the routed experts) above the
    current one at which a rank's expert weights take at most a quarter of the GPU; None without experts."""
    routed = getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0) or 0
    current = plan_kwargs.get("ep_size", 1)
    if routed <= 1 or current >= routed:
        return None
    dtype_bytes = plan_kwargs.get("dtype_bytes", 2)
    budget = plan_kwargs.get("gpu_memory_gib", GPU_MEMORY_GIB["h200"]) * GiB / 4
    ep = current * 2
    while ep < routed and count_parameters(config, ep)[1] * dtype_bytes > budget:
        ep *= 2
    return min(ep, routed)


def suggest_changes(
    config, prompt_tokens: int, page_size: int = 16384, vary_prompt: bool = True, **plan_kwargs
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
        page_size: tokens per K/V page.
        vary_prompt: also suggest a smaller prompt.
        plan_kwargs: :func:`plan_memory`'s other arguments (``gpu_memory_gib``, ``lora_rank``, ...).

    Returns:
        `list[Suggestion]`: fewest changes first; empty when the plan fits already or nothing tried fits.
    """
    as_given = plan_memory(config, prompt_tokens, page_size=page_size, **plan_kwargs)
    if as_given.fits:
        return []
    levers: list[tuple[list[str], dict[str, Any]]] = []
    if not plan_kwargs.get("checkpoint_layers"):
        levers.append((["--checkpoint-layers"], {"checkpoint_layers": True}))
    if not plan_kwargs.get("lora_rank"):
        levers.append((["--lora-rank", str(SUGGESTED_LORA_RANK)], {"lora_rank": SUGGESTED_LORA_RANK}))
    ep = _suggested_ep(config, plan_kwargs)
    if ep:
        levers.append((["--ep", str(ep)], {"ep_size": ep}))
    if plan_kwargs.get("offload") is None:
        levers.append((["--offload", "cpu"], {"offload": "cpu"}))
    chunk = _suggested_chunk(config, prompt_tokens, page_size, plan_kwargs, as_given.peak)
    if chunk:
        levers.append((["--chunk-size", str(chunk)], {"capture_chunk_size": chunk}))
    out: list[Suggestion] = []
    fits_alone: list[frozenset[int]] = []
    best: dict[frozenset[int], tuple[int | None, int]] = {}  # lever set -> (smallest cp, largest prompt)
    for n in range(len(levers) + 1):
        for combo in itertools.combinations(range(len(levers)), n):
            chosen = frozenset(combo)
            if any(s <= chosen for s in fits_alone):
                continue
            args = [a for i in combo for a in levers[i][0]]
            options = {k: v for i in combo for k, v in levers[i][1].items()}
            kwargs = {**plan_kwargs, **options}
            if combo:
                plan = plan_memory(config, prompt_tokens, page_size=page_size, **kwargs)
                if plan.fits:
                    out.append(Suggestion.of(args, options, prompt_tokens, plan))
                    fits_alone.append(chosen)
                    continue
            parts = [v for s, v in best.items() if s < chosen]
            cp, at_cp = _smallest_cp(config, prompt_tokens, page_size, kwargs) or (None, None)
            if cp and all(c is None or cp < c for c, _ in parts):
                with_cp = {**options, "cp_size": cp}
                out.append(Suggestion.of(args + ["--cp", str(cp)], with_cp, prompt_tokens, at_cp))
            p = largest_prompt(config, page_size=page_size, **kwargs) if vary_prompt else 0
            if p and all(p > q for _, q in parts):
                plan = plan_memory(config, p, page_size=page_size, **kwargs)
                out.append(Suggestion.of(args + ["--prompt", str(p)], options, p, plan))
            best[chosen] = (cp, p)
    return out


def format_suggestions(suggestions: list[Suggestion], gpu_bytes: int) -> str:
    """The text ``longstraw plan`` prints under a plan that does not fit."""
    if not suggestions:
        return (
            f"nothing tried fits {gpu_bytes / GiB:.2f} GiB: --checkpoint-layers, --lora-rank {SUGGESTED_LORA_RANK}, "
            f"--ep (MoE), --offload cpu (within --host-memory), a --chunk-size down to {SMALLEST_SUGGESTED_CHUNK}, "
            "a larger --cp and a smaller --prompt, alone or together"
        )
    width = max(len(" ".join(s.args)) for s in suggestions)
    lines = [f"to fit {gpu_bytes / GiB:.2f} GiB, change any one of (each re-planned):"]
    for s in suggestions:
        host = ""
        if s.host_bytes and s.host_pinned_bytes == s.host_bytes:
            host = f" (+ {s.host_bytes / GiB:.2f} GiB of pinned host memory a rank)"
        elif s.host_bytes:
            host = (
                f" (+ {s.host_bytes / GiB:.2f} GiB of host memory a rank, {s.host_pinned_bytes / GiB:.2f} GiB of "
                "it pinned)"
            )
        lines.append(f"  {' '.join(s.args):<{width}}  ->  peak {s.peak / GiB:.2f} GiB{host}")
    return "\n".join(lines)


def format_plan(plan: MemoryPlan) -> str:
    def g(x: int) -> str:
        return f"{x / GiB:10.2f} GiB"

    lines = [
        f"parameters {plan.params / 1e9:.2f} B on this rank, trainable {plan.trainable_params / 1e9:.3f} B",
        f"  weights           {g(plan.weights)}",
        f"  gradients         {g(plan.gradients)}",
        f"  optimizer         {g(plan.optimizer)}",
    ]
    if plan.fsdp_gathered:
        lines += [
            f"  FSDP2 gathered    {g(plan.fsdp_gathered)}  (root + two decoder layers, unsharded; the capture holds "
            f"the two layers, {g(plan.fsdp_gathered_in_capture).strip()})",
            f"  unsharded grads   {g(plan.fsdp_unsharded_gradients)}  (accumulated under no_sync until the step's last backward)",
        ]
    for kind, n in plan.state_by_kind.items():
        lines.append(f"  state[{kind}]{' ' * (11 - len(kind))}{g(n)}")
    if plan.host_state:
        lines += [
            f"  of it on the host {g(plan.host_state)}  (pinned; not in the GPU peaks)",
            f"  streamed back     {g(plan.offload_workspace)}  (the running layer's)",
        ]
    lines += [
        f"  response graph    {g(plan.response_graph)}",
        f"  logits/head temp  {g(plan.logits)}",
        f"  capture chunk     {g(plan.capture_workspace)}",
    ]
    if plan.gradient_buffers or plan.kept_boundaries:
        lines += [
            f"  full-grad buffers {g(plan.gradient_buffers)}"
            + (
                f"  (of it on the host {g(plan.host_gradient_buffers)})" if plan.host_gradient_buffers else ""
            ),
            f"  kept boundaries   {g(plan.kept_boundaries)}"
            + (f"  (of it on the host {g(plan.host_kept_boundaries)})" if plan.host_kept_boundaries else ""),
            f"  page dK/dV temp   {g(plan.page_grad_workspace)}",
            f"  prompt bwd graph  {g(plan.prompt_backward_graph)}",
            f"  kept page parts   {g(plan.prompt_backward_page_parts)}",
        ]
    lines += [
        f"capture peak        {g(plan.capture_peak)}",
        f"replay peak         {g(plan.replay_peak)}",
        *([f"prompt bwd peak     {g(plan.prompt_backward_peak)}"] if plan.prompt_backward_graph else []),
        f"GPU memory          {g(plan.gpu_bytes)}  ->  {'FITS' if plan.fits_gpu else 'DOES NOT FIT'}",
    ]
    if plan.host_bytes:
        lines.append(
            f"host memory         {g(plan.host_memory)}  ->  {'FITS' if plan.fits_host else 'DOES NOT FIT'}"
            + (
                "  (pinned, this rank's share)"
                if plan.host_pinned_bytes == plan.host_bytes
                else f"  (this rank's share; {g(plan.host_pinned_bytes).strip()} of the {g(plan.host_bytes).strip()} "
                "pinned: the dK/dV buffers are pageable)"
            )
        )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Positions: does the model take P + R positions at all?
# ----------------------------------------------------------------------------------------------------
#: RoPE types whose frequencies depend on the length of each call: the engine refuses them (model_patches/base.py)
CALL_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_entries(config) -> list[tuple[str | None, dict]]:
    """``(layer type or None, RoPE parameters)`` of each RoPE the config declares: transformers 5's
    ``rope_parameters`` (flat, or one dict per layer type), else a transformers 4 ``rope_scaling`` + ``rope_theta``."""
    rope = getattr(config, "rope_parameters", None)
    if not rope:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
        if theta is not None:
            scaling.setdefault("rope_theta", theta)
        rope = scaling
    if not rope:
        return []
    if hasattr(config, "nested_rope_parameter_keys"):
        nested = config.nested_rope_parameter_keys(rope)
    else:
        nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        return [(key, dict(rope[key])) for key in nested if rope[key] is not None]
    return [(None, dict(rope))]


@dataclass
class PositionCheck:
    """Whether the model takes ``needed`` = P + R positions (see :func:`check_positions`).

    Args:
        needed: prompt plus completion tokens, the positions one response's last token sits at.
        max_position_embeddings: the config's; the engine refuses more (``PromptTooLongError``).
        rope: one line per RoPE the config declares (per layer type in transformers 5), with its reach.
        limit: the most positions the model takes: the smaller of ``max_position_embeddings`` and the reach
            of a YaRN scaling (``factor`` x ``original_max_position_embeddings``); None when nothing bounds it.
        problems: what stops P + R, each with what to change; empty when it runs.
    """

    needed: int
    max_position_embeddings: int | None
    rope: list[str]
    limit: int | None
    #: what sets ``limit``: ``"max_position_embeddings"``, ``"the YaRN scaling"``, or None
    limited_by: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def check_positions(config, prompt_tokens: int, response_tokens: int) -> PositionCheck:
    """Check P + R against what the config's positions allow, and say what to change when they do not.

    Two limits: the engine refuses a prompt + completion beyond ``max_position_embeddings``
    (``engine.check_max_position_embeddings``), and a YaRN scaling extends RoPE to ``factor`` x
    ``original_max_position_embeddings`` (transformers' ``_compute_yarn_parameters``; without ``factor``:
    ``max_position_embeddings`` / ``original_max_position_embeddings``), past which the model attends at positions
    its scaling was not made for. Without scaling (``default``), ``max_position_embeddings`` is taken as the trained
    length. Linear and llama3 scaling do not say how far they reach: only ``max_position_embeddings`` bounds them.
    ``dynamic`` and ``longrope`` (frequencies that depend on each call's length) are refused by the engine at any
    length. Sliding-window layers' RoPE is not checked: their queries see keys at most ``sliding_window`` back.
    """
    needed = prompt_tokens + response_tokens
    mpe = getattr(config, "max_position_embeddings", None)
    window = getattr(config, "sliding_window", None)
    lines: list[str] = []
    problems: list[str] = []
    reaches: list[tuple[int, str, int]] = []  # (reach, description, original) of each YaRN
    unscaled = False
    for layer_type, params in _rope_entries(config):
        rtype = params.get("rope_type") or params.get("type") or "default"
        where = f"{layer_type}: " if layer_type else ""
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        desc = f"{where}rope_type={rtype!r}"
        if factor is not None:
            desc += f", factor={factor:g}"
        if original is not None:
            desc += f", original_max_position_embeddings={original:,}"
        if layer_type == "sliding_attention" and window:
            lines.append(f"{desc} (sliding window {window:,}: not a limit)")
            continue
        if rtype in CALL_DEPENDENT_ROPE:
            lines.append(desc)
            problems.append(
                f"{where}rope_type={rtype!r} is refused by LongStraw at any length (its frequencies depend on each "
                "call's length, which a chunked capture cannot reproduce): use 'yarn' with a factor and "
                "original_max_position_embeddings instead"
            )
            continue
        if rtype == "yarn":
            original = original or mpe
            if factor is None and mpe and original:
                factor = mpe / original
            if factor and original:
                reach = int(factor * original)
                reaches.append((reach, desc, original))
                desc += f" -> reaches {reach:,} positions"
        elif rtype == "default":
            unscaled = True
            desc += " (no scaling)"
        lines.append(desc)
    limit, limited_by = mpe, "max_position_embeddings" if mpe is not None else None
    for reach, _, _ in reaches:
        if limit is None or reach < limit:
            limit, limited_by = reach, "the YaRN scaling"
    raise_mpe = f"set max_position_embeddings >= {needed:,} in config.json"
    shorter = (
        f"or plan a shorter --prompt (at most {limit - response_tokens:,} with --response {response_tokens:,})"
        if limit is not None and limit > response_tokens
        else "or shorten the prompt and the response"
    )
    short_yarn = [(r, d, o) for r, d, o in reaches if r < needed]
    if short_yarn:
        for reach, desc, original in short_yarn:
            problems.append(
                f"the YaRN scaling ({desc.split(' -> ')[0]}) reaches {reach:,} positions < P + R = {needed:,}: set its "
                f"factor to {math.ceil(needed / original)}.0 or more ({needed:,} / {original:,} = {needed / original:.2f}) and "
                f"{raise_mpe} (a factor the model was not tuned with may cost quality), {shorter}"
            )
    elif mpe is not None and needed > mpe:
        if reaches:
            what = (
                f"the RoPE scaling reaches {min(r for r, _, _ in reaches):,}: {raise_mpe}, "
                "as LongStraw's engine refuses positions past it"
            )
        elif unscaled:
            what = (
                f"without RoPE scaling the model knows {mpe:,} positions: add a YaRN scaling, rope_parameters "
                f'{{"rope_type": "yarn", "factor": {math.ceil(needed / mpe)}.0, '
                f'"original_max_position_embeddings": {mpe}}} (rope_scaling in a transformers 4 config), and '
                f"{raise_mpe} (a factor the model was not tuned with may cost quality)"
            )
        else:
            what = f"{raise_mpe} with a RoPE scaling that reaches that far (e.g. yarn)"
        problems.append(
            f"P + R = {needed:,} > max_position_embeddings = {mpe:,}: LongStraw refuses it "
            f"(PromptTooLongError); {what}, {shorter}"
        )
    return PositionCheck(needed, mpe, lines, limit, limited_by, problems)


def format_positions(check: PositionCheck) -> str:
    """The positions section of ``longstraw plan``'s text."""
    limit = f"{check.limit:,} ({check.limited_by})" if check.limit is not None else "no limit in the config"
    verdict = "OK" if check.ok else "DOES NOT RUN"
    lines = [
        f"positions           P + R = {check.needed:,}, the model takes {limit}  ->  {verdict}",
        f"  max_position_embeddings {check.max_position_embeddings:,}"
        if check.max_position_embeddings is not None
        else "  max_position_embeddings not set",
    ]
    lines += [f"  RoPE {r}" for r in check.rope] or ["  no RoPE parameters in the config"]
    for p in check.problems:
        lines += textwrap.wrap(p, 110, initial_indent="problem: ", subsequent_indent="  ")
    return "\n".join(lines)
