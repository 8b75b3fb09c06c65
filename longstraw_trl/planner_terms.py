"""The memory planner's terms, each from the model config: parameter counts (on the meta device, exact), FSDP2
shards, and the prompt state with what offload and the full gradient add to it (each layer's ``LayerState``
formulas, exact, as ``PromptState.nbytes``)."""

from __future__ import annotations

import math

import torch

from .errors import UnsupportedModelError
from .host_memory import DeviceShare
from .layer_state import owned_tokens
from .model_patches import patch_for_model_type
from .model_patches.planned_bytes import attention_head_dim


def planned_layer_types(config) -> list[str]:
    """``config.layer_types`` (cut to ``num_hidden_layers``), else every layer ``"full_attention"``."""
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


def lora_parameters(config, rank: int) -> int:
    """LoRA params on every non-expert Linear of the decoder (attention, GDN and MLP projections)."""
    return rank * _meta_counts(config, 1)[3]


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


def _state_types(config) -> list[tuple[int, type]]:
    """``(layer, LayerState class)`` of every layer that keeps a prompt state (the family's
    ``layer_state_type``; ``None`` for blocks that keep none, e.g. Nemotron-H's MLP and MoE blocks)."""
    patch = patch_for_model_type(config.model_type)
    kinds = ((i, patch.layer_state_type(config, i)) for i in range(len(planned_layer_types(config))))
    return [(i, cls) for i, cls in kinds if cls is not None]


def _tokens(prompt_tokens: int, cp_size: int, page_size: int) -> tuple[int, int]:
    """``(resident, on rank 0)``: the ``P - 1`` resident tokens, and those the rank holding the most pages stores."""
    resident = max(prompt_tokens - 1, 0)
    return resident, owned_tokens(0, resident, page_size, 0, cp_size)


def _boundaries(resident: int, chunk_size: int) -> int:
    """Capture-chunk boundaries inside ``resident`` tokens."""
    return max(-(-resident // chunk_size) - 1, 0)


def state_bytes(config, prompt_tokens: int, cp_size: int = 1, page_size: int = 16384, dtype_bytes: int = 2):
    """Per-rank prompt state by kind: each layer's ``LayerState.planned_bytes`` (the class its family patch
    keeps there), for the ``P - 1`` resident tokens on the rank holding the most pages (rank 0)."""
    resident, on_rank = _tokens(prompt_tokens, cp_size, page_size)
    out: dict[str, int] = {}
    for i, cls in _state_types(config):
        tokens = on_rank if cls.sharded else resident
        for kind, n in cls.planned_bytes_by_kind(config, i, tokens, dtype_bytes).items():
            out[kind] = out.get(kind, 0) + n
    return out


def offload_bytes(
    config,
    prompt_tokens: int,
    cp_size: int = 1,
    page_size: int = 16384,
    dtype_bytes: int = 2,
    device_state_bytes: int = 0,
) -> tuple[int, int, int]:
    """``(host bytes, device workspace, kept bytes)`` per rank with ``offload_prompt_state="cpu"``: the state of every
    offloadable layer kind (``LayerState.offloadable``: K/V pages, MLA latent and indexer keys; GDN and window states
    stay on the device) in host memory, and the most that one running layer streams back
    (``LayerState.planned_offload_workspace``). ``device_state_bytes``: the device share whole layers stay within,
    in layer order (:class:`~longstraw_trl.host_memory.DeviceShare`, the capture's rule); those (the kept bytes)
    neither go to the host nor stream."""
    resident, on_rank = _tokens(prompt_tokens, cp_size, page_size)
    share = DeviceShare(device_state_bytes)
    host = workspace = 0
    for i, cls in _state_types(config):
        if not cls.offloadable:
            continue
        tokens = on_rank if cls.sharded else resident
        nbytes = cls.planned_bytes(config, i, tokens, dtype_bytes)
        if share.take(nbytes):
            continue
        host += nbytes
        workspace = max(workspace, cls.planned_offload_workspace(config, i, tokens, page_size, dtype_bytes))
    return host, workspace, share.taken


def kept_page_parts_bytes(config, types: list[str], tokens: int) -> int:
    """Bytes a checkpointed call over ``tokens`` queries keeps from each attention layer's first forward for its
    recompute (``context.ForwardContext._prompt_part``): the queries' attention over the prompt pages, fp32 out and LSE,
    ``[Hq, tokens, d + 1]`` a layer. Sliding-window layers keep none (their window is recomputed)."""
    head_dim = attention_head_dim(config)
    attention_layers = sum(t == "full_attention" for t in types)
    return attention_layers * tokens * config.num_attention_heads * (head_dim + 1) * 4


def full_gradient_bytes(
    config,
    prompt_tokens: int,
    cp_size: int = 1,
    page_size: int = 16384,
    dtype_bytes: int = 2,
    chunk_size: int = 8192,
    offload_prompt_state: str | None = None,
) -> tuple[int, int, int, int, int]:
    """``(gradient buffers, kept boundary states, page-gradient workspace, host gradient buffers, host kept
    boundary states)`` per rank for ``gradient_mode="full"``: a ``"buffer"`` kind (K/V pages) accumulates fp32
    dK/dV of its own size (beside its pages: in host memory when ``offload_prompt_state="cpu"`` offloads the
    kind), and one layer's dK/dV are computed in fp32 on the device at a time; a ``"leaf"`` kind (GDN) keeps a
    gradient of its size on the device and a copy of the state at every capture-chunk boundary (in host memory with
    ``offload_prompt_state="cpu"``). The first two include the host parts. Raises
    :class:`~longstraw_trl.errors.UnsupportedModelError` for a layer kind without a full gradient."""
    resident, on_rank = _tokens(prompt_tokens, cp_size, page_size)
    boundaries = _boundaries(resident, chunk_size)
    buffers = kept = workspace = host_buffers = 0
    for i, cls in _state_types(config):
        n = cls.planned_bytes(config, i, on_rank if cls.sharded else resident, dtype_bytes)
        if cls.grad_kind == "buffer":
            fp32 = cls.planned_grad_bytes(config, i, on_rank if cls.sharded else resident, dtype_bytes)
            buffers += fp32
            workspace = max(workspace, fp32)
            if offload_prompt_state == "cpu" and cls.offloadable:
                host_buffers += fp32
        elif cls.grad_kind == "leaf":
            buffers += n
            kept += boundaries * n
        else:
            raise UnsupportedModelError(
                f"gradient_mode='full' has no full gradient for the {cls.__name__} of layer {i} ({config.model_type})"
            )
    return buffers, kept, workspace, host_buffers, kept if offload_prompt_state == "cpu" else 0


def fixed_state_bytes(config, prompt_tokens: int, dtype_bytes: int = 2) -> int:
    """The fixed-size layer states (GDN, sliding windows) of one prompt's state: what a trunk that
    ``prompt_prefix_sharing`` captures holds of its own (its K/V pages are the branches' prefix views)."""
    resident = max(prompt_tokens - 1, 0)
    return sum(
        cls.planned_bytes(config, i, resident, dtype_bytes)
        for i, cls in _state_types(config)
        if not cls.sharded
    )


def shared_prefix_boundary_bytes(
    config, prompt_tokens: int, dtype_bytes: int = 2, chunk_size: int = 8192
) -> int:
    """``prompt_prefix_sharing="all"``: the fixed-size layer states (GDN, sliding windows) a policy capture keeps at
    every capture-chunk boundary, where a later prompt may branch off (growing kinds give a prefix view instead)."""
    resident = max(prompt_tokens - 1, 0)
    return _boundaries(resident, chunk_size) * fixed_state_bytes(config, prompt_tokens, dtype_bytes)
