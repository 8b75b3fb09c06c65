"""Expert parallelism: transformers' own EP over groups of ``ep_size`` consecutive ranks inside a CP group.

:class:`ExpertParallel` applies transformers' EP (``transformers.distributed.expert_parallel``: the model config's
``base_model_ep_plan``, ``grouped_gemm`` sharding of the fused expert weights on dim 0 and an ``ep_dispatch_experts``
implementation) over groups of ``ep_size`` consecutive ranks *inside* a CP group. Those ranks hold the same batch (the
same prompt chunks, decode steps and replays, in step), which is what transformers' ``"all_reduce"`` implementation
needs; no LongStraw code shards or dispatches tokens. Gradients (docs/parallelism.md): dense parameters are reduced by
DDP or FSDP2 (the mean over the world; identical on the ranks of a CP group; under FSDP2 the experts are left out of
``fully_shard``, :meth:`ExpertParallel.keep_out_of_fsdp`); each expert lives on one rank of every EP group, and its
gradient is averaged over its replicas, the ranks with the same EP index in the other EP groups
(:meth:`ExpertParallel.reduce_gradients`), never over the EP group itself.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

from .constants import EP_IMPLEMENTATIONS
from .errors import LongStrawError, UnsupportedModelError
from .parallel_dims import check_expert_parallel_world

EP_DISPATCH = "ep_dispatch_experts"


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
    check_expert_parallel_world(ep_size, world)


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
