"""Context parallelism over prompt pages, and expert parallelism over the same ranks.

Global page ``j`` of every full-attention layer lives on rank ``j % cp_size`` of the CP group; GDN
states, weights and the response are replicated. Every rank runs every prompt chunk and every response;
an attention layer computes ``(out, lse)`` over its own pages, all-gathers the partials and merges them
in rank order (so every rank holds the same result), then adds the causal response part. Backward
needs the page part's dQ only: each rank computes it from its pages and the all-reduce sums it, so
parameter gradients come out identical on every rank (docs/design.md, "Distributed, model-native
ownership").

Expert parallelism (:class:`ExpertParallel`): transformers' own EP (``transformers.distributed.expert_parallel``: the
model config's ``base_model_ep_plan``, ``grouped_gemm`` sharding of the fused expert weights on dim 0 and an
``ep_dispatch_experts`` implementation) applied over groups of ``ep_size`` consecutive ranks *inside* a CP group. Those
ranks hold the same batch (the same prompt chunks, decode steps and replays, in step), which is what transformers'
``"all_reduce"`` implementation needs; no LongStraw code shards or dispatches tokens. Gradients (docs/parallelism.md):
dense parameters are reduced by DDP or FSDP2 (the mean over the world; identical on the ranks of a CP group; under
FSDP2 the experts are left out of ``fully_shard``, :meth:`ExpertParallel.keep_out_of_fsdp`);
each expert lives on one rank of every EP group, and its gradient is averaged over its replicas, the ranks with the
same EP index in the other EP groups (:meth:`ExpertParallel.reduce_gradients`), never over the EP group itself.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

from .errors import LongStrawError, UnsupportedModelError

EP_IMPLEMENTATIONS = ("all_reduce", "all_to_all")
"""transformers' ``ep_implementation`` values that run on a batch shared by the EP group (both run over gloo)."""
EP_DISPATCH = "ep_dispatch_experts"


def merge_gathered(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attentions over disjoint key sets, in list order, without host sync.

    ``outs[r]`` is ``[..., T, D]`` and ``lses[r]`` ``[..., T]`` (fp32). A partial with ``lse = -inf``
    on a row (no keys: e.g. a rank that holds no pages yet) has weight ``exp(-inf - m) = 0`` there. The
    row maximum ``m`` is replaced by 0 where every partial is empty, so such a row comes out as
    ``out = 0, lse = -inf`` (no NaN). The same inputs in the same order give the same bits on every rank.
    """
    m = lses[0]
    for s in lses[1:]:
        m = torch.maximum(m, s)
    m = m.masked_fill(m == float("-inf"), 0.0)
    total, acc = None, None
    for o, s in zip(outs, lses, strict=True):
        w = torch.exp(s - m)
        wo = w.unsqueeze(-1) * o
        total, acc = (w, wo) if total is None else (total + w, acc + wo)
    lse = m + torch.log(total)  # total = 0 (every partial empty): lse = -inf
    out = acc / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, lse


class SingleRank:
    """The communicator of a prompt state without context parallelism: every collective is the identity (the same
    protocol as :class:`ContextParallel`)."""

    rank, size = 0, 1

    @staticmethod
    def reduce_partial(out, lse, q):
        return out, lse

    @staticmethod
    def reduce_dq(dq_pages, dq_self):
        return dq_pages + dq_self

    @staticmethod
    def all_reduce_sum(t):
        return t

    @staticmethod
    def all_gather(t):
        return [t]


def communicator(group) -> SingleRank | ContextParallel:
    """The collectives over a context-parallel ``group`` (``None``: a single rank)."""
    return SingleRank() if group is None else ContextParallel(group)


class ContextParallel:
    """Collectives of one context-parallel group (any backend: NCCL on GPUs, gloo on CPU)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def reduce_partial(self, out: torch.Tensor | None, lse: torch.Tensor | None, q: torch.Tensor):
        """Exact merge of every rank's prompt-part ``(out, lse)`` (``None``: this rank has no pages).

        Every rank contributes one fp32 tensor ``[B, H, T, D + 1]`` (``out`` with ``lse`` as its last
        column), whatever its pages: partials can be bf16 (CPU autocast) or fp32 (flash-attention's
        LSE, the plain-math path), and a rank without pages sends ``out = 0, lse = -inf``, which
        :func:`merge_gathered` weighs by 0 (the placeholder assumes the value head dim equals the
        query's, as in every supported family). No host sync: nothing here reads a tensor's values.
        """
        if out is None:
            b, h, t, d = q.shape
            part = q.new_zeros((b, h, t, d + 1), dtype=torch.float32)
            part[..., -1] = float("-inf")
        else:
            part = torch.cat([out.float(), lse.float().unsqueeze(-1)], dim=-1)
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.all_gather(parts, part, group=self.group)
        return merge_gathered([p[..., :-1] for p in parts], [p[..., -1] for p in parts])

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def reduce_dq(self, dq_pages: torch.Tensor, dq_self: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's page dQ plus the response part's dQ (fp32), bit-identical on every rank.

        The response part is computed redundantly on every rank, and GPU attention backward kernels
        accumulate dQ with atomics, so ranks can differ in the last bits: only the first rank's copy
        enters the all-reduce, whose result is the same on all ranks.
        """
        dq = dq_pages.float() + dq_self.float() if self.rank == 0 else dq_pages.float().contiguous()
        dist.all_reduce(dq, group=self.group)
        return dq

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks (a new tensor, the same on every rank)."""
        out = t.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (torch's ``fully_shard``, e.g. through Accelerate's FSDP plugin)."""
    return isinstance(model, FSDPModule)


def stage_on_host_for_fsdp2(model: nn.Module, world: int, free_bytes: int | None = None) -> int:
    """Move a not yet sharded ``model`` whose weights are on a GPU to the host where sharding it there would not fit
    beside them; returns the bytes moved (0: left where it is).

    Accelerate 1.15's FSDP2 preparation holds every original parameter (a ``state_dict()`` it keeps) while
    ``fully_shard`` copies each into this rank's shard, so during the wrapping a GPU holds the whole model plus the
    shards: twice the model at world size 1 (the whole Qwen3.6-27B with LoRA ran out of memory inside ``prepare`` on
    an 80 GB H100, docs/fsdp.md). From the host, ``fully_shard`` moves only the shards to the GPU. HF's Trainer leaves
    an FSDP model where it is, so a model loaded on the CPU (``from_pretrained``'s default) never needs this.
    ``free_bytes``: the GPU memory the shards may take (default: free plus the allocator's cached blocks)."""
    if is_fsdp2(model):
        return 0
    tensors = [*model.parameters(), *model.buffers()]
    if any(isinstance(t, DTensor) for t in tensors):  # experts split by EP: their local shards stay
        return 0
    on_gpu = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    if not on_gpu:
        return 0
    if free_bytes is None:
        free_bytes, _ = _available_device_bytes(next(t.device for t in tensors if t.is_cuda))
    total = sum(on_gpu.values())
    # this rank's shards, the trainable ones upcast to fp32 (Accelerate's masters under mixed precision), a margin
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad and p.is_cuda)
    needed = (total + trainable) // world + 2**30
    if needed <= free_bytes:
        return 0
    model.to("cpu")
    return total


def _param_groups(unit: FSDPModule) -> list:
    # FSDP2's per-unit parameter groups (torch >= 2.11 keeps a list; earlier releases one group)
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def _available_device_bytes(device: torch.device) -> tuple[int, int]:
    """What the GPU can still give (free plus the allocator's cached blocks), and its total memory."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def _gather_budget_bytes(device: torch.device) -> int:
    """What the GPU can still give less a margin for the work itself (2 GiB and 5% of the card); unbounded on the
    CPU."""
    if device.type != "cuda":
        return sys.maxsize
    available, total = _available_device_bytes(device)
    return max(0, available - 2**31 - total // 20)


@contextlib.contextmanager
def fsdp2_units_kept_gathered(model: nn.Module, budget_bytes: int | None = None) -> Iterator[int]:
    """Inside the block, ``model``'s FSDP2 units stay gathered from their first forward to the block's end, as many
    (in module order) as ``budget_bytes`` of gathered parameters allow (``None``: what the GPU can still give, less a
    margin; 0: none). Yields how many units still gather (and free) around every forward: the decode step then holds
    FSDP2's collectives, which the caller keeps out of a CUDA graph.

    A decode step runs every layer for one token, and FSDP2 gathers each unit before its forward and frees it after:
    R tokens cost R all-gathers of the whole model (at world size 1 a copy of it: generation took 2.3x the unwrapped
    model's on an H100, the 27B at 64K, R = 256, docs/fsdp.md). Kept gathered, a unit costs one. Units FSDP2 already
    keeps gathered after their forward (the root; Accelerate's output head) are left as they are."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    kept: list[FSDPModule] = []
    left = 0
    try:
        if units:
            device = next(p.device for p in model.parameters())
            budget = _gather_budget_bytes(device) if budget_bytes is None else budget_bytes
            for unit in units:
                groups = _param_groups(unit)
                # only units resharded after forward (FSDP2 keeps the others gathered; an int reshard_after_forward,
                # resharding to a smaller mesh, is left as it is and still gathers)
                if not groups or all(g.post_forward_mesh_info is None for g in groups):
                    continue
                size = sum(
                    fp.sharded_param.numel() * fp.sharded_param.element_size()
                    for g in groups
                    for fp in g.fsdp_params
                )
                if size > budget or any(g.post_forward_mesh_info != g.mesh_info for g in groups):
                    left += 1
                    continue
                budget -= size
                unit.set_reshard_after_forward(False, recurse=False)
                kept.append(unit)
        yield left
    finally:
        for unit in kept:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def fit_fsdp_wrap_classes(plugin, model: nn.Module) -> list[str]:
    """Give Accelerate's transformer-based FSDP wrap policy only the layer classes ``model`` has.

    With ``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`` and no layer class named, Accelerate wraps the classes
    of the model's ``_no_split_modules`` and raises for any it cannot find. A text-only model that shares its
    modeling file with a vision-language one lists the vision tower's block too (``Qwen3_5ForCausalLM``:
    ``Qwen3_5VisionBlock``), so FSDP2 refused the whole Qwen3.5/3.6 family ("Could not find the transformer layer
    class Qwen3_5VisionBlock"). Classes the user named are left alone.

    A model an earlier trainer already sharded (a second trainer on the same model, as a warm-up step then the real
    one) holds its layers as FSDP2's subclasses (``FSDPQwen3DecoderLayer``), which Accelerate does not find by the
    original name ("Could not find the transformer layer class Qwen3DecoderLayer"): the subclass's name is given then,
    and Accelerate leaves the sharded layers as they are. Returns the classes dropped."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin is None or plugin.auto_wrap_policy is not transformer_auto_wrap_policy:
        return []
    if plugin.transformer_cls_names_to_wrap is not None:
        return []
    # each module's class name; a sharded layer's original class name too, to its FSDP2 subclass's (``FSDP<name>``)
    actual: dict[str, str] = {}
    for module in model.modules():
        own = type(module).__name__
        actual.setdefault(own, own)
        if isinstance(module, FSDPModule):
            actual.setdefault(own.removeprefix("FSDP"), own)
    listed = list(getattr(model, "_no_split_modules", None) or [])
    present = [actual[name] for name in listed if name in actual]
    if present:  # none present: Accelerate's own error says so
        plugin.transformer_cls_names_to_wrap = present
    return [name for name in listed if name not in actual]


def new_cp_groups(cp_size: int):
    """Split the world into consecutive groups of ``cp_size`` ranks; returns this rank's group.

    Every rank must call this (``new_group`` is collective). With ``cp_size == 1`` returns ``None``.
    """
    if cp_size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp_size:
        raise ValueError(f"world size {world} is not a multiple of cp_size {cp_size}")
    mine = None
    for start in range(0, world, cp_size):
        group = dist.new_group(list(range(start, start + cp_size)))
        if start <= rank < start + cp_size:
            mine = group
    return mine


def expert_parallel_plan(model: nn.Module) -> dict[str, str]:
    """The model's EP plan (``model.ep_plan``: ``base_model_ep_plan`` of its config, prefixed by the children's names)
    expanded to concrete module and parameter names, each module's parameters before the module (the order
    ``apply_expert_parallelism`` shards, then hooks). Empty for a model without one (a dense model)."""
    plan = dict(getattr(model, "ep_plan", None) or {})
    expanded: dict[str, str] = {}
    if not plan:
        return expanded
    for name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{name}.{param_name}" if name else param_name
            style = plan.get(replace_layer_number_by_wildcard(full))
            if style is not None:
                expanded[full] = style
        style = plan.get(replace_layer_number_by_wildcard(name))
        if style is not None:
            expanded[name] = style
    return expanded


def num_routed_experts(config) -> int | None:
    """Routed experts per MoE layer of a (text) config: ``num_experts``, ``n_routed_experts`` (GLM, DeepSeek) or
    ``num_local_experts`` (GPT-OSS); ``None`` for a dense model."""
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(config, attr, None)
        if value:
            return int(value)
    return None


def check_expert_parallel(model: nn.Module, ep_size: int, world: int, fsdp: bool = False) -> None:
    """Refuse what :class:`ExpertParallel` cannot run, each with what to change: a model already sharded by FSDP2
    (``fsdp``: the experts must be split before ``fully_shard`` runs, so that it can leave them out), a dense model,
    an ``ep_size`` that does not divide the routed experts or the ``world`` size (1 without a distributed launch)."""
    if fsdp:
        raise LongStrawError(
            f"ep_size={ep_size} on a model that is already sharded by FSDP2 (an FSDPModule, e.g. loaded with "
            "transformers' DistributedConfig(fsdp_size=...)): fully_shard has already taken the experts' weights as "
            "flat shards over its mesh, and transformers' EP needs them whole to split them over the EP groups. Pass "
            "an unsharded model and launch with Accelerate's FSDP2 plugin (examples/accelerate/fsdp2.yaml): the "
            "trainer splits the experts first and keeps them out of fully_shard."
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = num_routed_experts(config)
    if experts is None:
        raise UnsupportedModelError(
            f"ep_size={ep_size} on a dense model ({type(model).__name__}, no routed experts). Set ep_size=1."
        )
    if experts % ep_size:
        raise LongStrawError(
            f"ep_size={ep_size} does not divide the model's {experts} routed experts per layer; choose an ep_size "
            f"that divides {experts}."
        )
    if world % ep_size or world == 1:
        raise LongStrawError(
            f"ep_size={ep_size} needs a distributed launch whose world size is a multiple of it (got {world} "
            "process(es))."
        )


class ExpertParallel:
    """transformers' expert parallelism over groups of ``ep_size`` consecutive ranks, and the gradient rule it needs.

    Args:
        model: the transformers model (no peft / DDP wrapper) whose experts to shard. Its weights must be equal on
            every rank (each rank keeps its own slice: ``distribute_tensor(src_data_rank=None)``, no communication).
        ep_size: ranks per EP group; must divide the world size (the trainer also asks it to divide ``cp_size``, so
            the EP group shares one batch).
        implementation: transformers' ``ep_implementation`` (:data:`EP_IMPLEMENTATIONS`). ``"all_reduce"``: every rank
            runs its experts on every token (routes to other ranks' experts masked, weight 0) and an all-reduce sums
            the outputs; no host sync, so decode steps stay CUDA graphs. ``"all_to_all"``: the ranks slice the shared
            batch, exchange the (token, expert) pairs and all-gather the slices back (reads split sizes on the host).

    The mesh is ``(ep_replicate, ep)`` over the world, ``ep`` innermost: EP groups ``{0..ep-1}, {ep..2ep-1}, ...``
    (inside the CP groups, which are consecutive too), replica groups ``{r, r + ep, ...}``.
    """

    def __init__(self, model: nn.Module, ep_size: int, implementation: str = "all_reduce"):
        if implementation not in EP_IMPLEMENTATIONS:
            raise LongStrawError(
                f"ep_implementation must be one of {', '.join(EP_IMPLEMENTATIONS)}, got {implementation!r}."
            )
        world = dist.get_world_size()
        if world % ep_size:
            raise LongStrawError(f"ep_size={ep_size} does not divide the world size {world}.")
        plan = expert_parallel_plan(model)
        if EP_DISPATCH not in plan.values():
            raise LongStrawError(
                f"ep_size={ep_size} on a {type(model).__name__}: its config has no expert-parallel plan "
                "(`base_model_ep_plan` with an `ep_dispatch_experts` rule), e.g. a dense model. Set ep_size=1."
            )
        modules = dict(model.named_modules())
        for name, style in plan.items():
            if style == EP_DISPATCH and hasattr(modules[name], "base_layer"):
                raise LongStrawError(
                    f"{name} is wrapped by a PEFT adapter: LoRA on MoE expert weights with ep_size > 1 is not "
                    "supported (the adapter would wrap the sharded experts). Leave the experts out of target_modules: "
                    "PEFT also maps the MLP projection names (gate_proj, up_proj, down_proj, and 'all-linear') onto "
                    "the fused experts of a transformers-5 MoE model, so target the attention projections by name "
                    "(docs/parallelism.md)."
                )
        device = next(model.parameters()).device.type
        self.size = ep_size
        self.mesh = init_device_mesh(
            device, (world // ep_size, ep_size), mesh_dim_names=("ep_replicate", "ep")
        )
        self.group = self.mesh["ep"].get_group()
        self.replicas = world // ep_size
        self.replica_group = self.mesh["ep_replicate"].get_group() if self.replicas > 1 else None
        apply_expert_parallelism(
            model, self.mesh["ep"], self.mesh["ep"], plan, ep_implementation=implementation
        )
        self.parameters = [p for p in model.parameters() if isinstance(p, DTensor)]

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` that hold the sharded expert parameters (the plan's ``ep_dispatch_experts``
        modules, e.g. ``layers.N.mlp.experts``), checked to hold exactly those parameters."""
        mine = {id(p) for p in self.parameters}
        modules = [m for m in model.modules() if getattr(m, "_is_expert_parallel", False)]
        held = {id(p) for m in modules for p in m.parameters()}
        if held != mine:
            raise LongStrawError(
                "the expert-parallel modules do not hold exactly the sharded expert parameters "
                f"({len(held)} held, {len(mine)} sharded): cannot keep the experts out of FSDP2."
            )
        return modules

    def keep_out_of_fsdp(self, plugin, model: nn.Module) -> None:
        """Make Accelerate's FSDP2 plugin leave the experts out of ``fully_shard`` (its ``ignored_modules``, passed to
        every ``fully_shard`` call as ``ignored_params``): they stay DTensor shards on the EP mesh, unsharded by
        FSDP2 and never reduced by it (:meth:`reduce_gradients` averages them over their replicas). The dense
        parameters are sharded over the world as without EP. A user's own ``ignored_modules`` (modules or a regular
        expression of module names) is kept."""
        experts = self.expert_modules(model)
        user = plugin.ignored_modules
        if isinstance(user, str):
            reg = re.compile(user)
            user = [m for n, m in model.named_modules() if reg.fullmatch(n)]
        plugin.ignored_modules = list(user or []) + [
            m for m in experts if all(m is not u for u in user or [])
        ]

    def ignored_by_ddp(self, model: nn.Module) -> list[str]:
        """Names (in ``model``, e.g. a peft wrapper of the sharded model) of the expert parameters, for DDP's
        ``_ddp_params_and_buffers_to_ignore``: DDP would broadcast rank 0's experts over the others and average
        different experts' gradients."""
        mine = {id(p) for p in self.parameters}
        return [n for n, p in model.named_parameters() if id(p) in mine]

    def full_state_dict(self, model: nn.Module, keep: bool) -> dict:
        """``model.state_dict()`` with every expert shard gathered whole (``DTensor.full_tensor``, a collective over
        its EP group: call it on every rank, in step). ``keep``: this rank writes the checkpoint and keeps the
        result, the gathered experts on the host; other ranks only join the gathers and get ``{}``."""
        out = {}
        for name, value in model.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
                value = value.cpu() if keep else None
            if keep:
                out[name] = value
        return out

    def reduce_gradients(self) -> None:
        """Average each expert gradient over its replicas (in place), once per optimizer step, after the step's last
        backward. The EP group itself is never reduced over: an expert's gradient on its owner already holds every
        token of the batch the group shares (the dispatch's backward brings them), and its other ranks hold other
        experts. Dividing by the replicas matches DDP's mean over the world for the dense parameters, whose ranks
        of one EP group hold identical gradients."""
        if self.replica_group is None:
            return
        for p in self.parameters:
            if p.grad is not None:
                local = p.grad.to_local()
                dist.all_reduce(local, group=self.replica_group)
                local.div_(self.replicas)
