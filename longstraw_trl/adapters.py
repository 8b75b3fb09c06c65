"""PEFT adapters in graph-free passes: run them in their base layer's dtype.

PEFT upcasts adapter weights to fp32 beside a bf16 model (``autocast_adapter_dtype=True``, its default), so
every adapted linear layer casts its input to fp32 and runs two fp32 GEMMs, which get no bf16 tensor-core
rate. In a capture of the whole Qwen3.6-27B with LoRA r=64 on every linear layer that is about a quarter of
the GPU time (fp32 GEMMs and the casts around them; ``bench/results/profile_qwen3.6-27b_h200_P65536_capture.json``).

Without autograd nothing reads the fp32 copies but the forward itself, so for the duration of a capture or
a generation :func:`adapters_in_model_dtype` points each adapter parameter at a copy in its base layer's
dtype and restores the original afterwards. The adapter's contribution is then rounded to bf16 before it is
added, an error of the order of bf16 rounding of that contribution, which is itself added to (and rounded
with) the base layer's bf16 output. The passes that train or score (every replay: policy, old and reference
log-probs) never use that cast: they run the adapters' parameters as PEFT holds them.

In the same block a plain LoRA layer (one active adapter, no dropout, no variant such as DoRA, no LoRA bias, an
``nn.Linear`` base) also adds its update in the base output's GEMM epilogue: ``result.addmm_(x A^T, B^T,
alpha=scaling)``. PEFT runs ``result + lora_B(lora_A(x)) * scaling``: a GEMM writing the update, a multiply and an
add, three more passes over the layer's output and two more kernels per adapted layer, which in a whole-model
capture or decode step are thousands of launches and passes over every linear layer's output. The update is
then accumulated once in fp32 and rounded once, instead of rounded after each of the three steps. With
``differentiable=True`` (``autograd_fused_kernels``: the loss binds it for each micro-batch, so that a checkpointed
recompute takes the same path) the passes that train take the same epilogue out of place (``torch.addmm``): the
scale then multiplies the ``[T, r]`` operand's gradient, not the ``[T, out]`` output and its gradient, one multiply and
one add over every adapted layer's output less a forward (equal to PEFT's forward and gradients in fp32; under bf16
autocast within twice PEFT's own bf16 error, ``tests/test_adapters.py``).

In the passes that train, under autocast (TRL's default ``bf16=True``), PEFT's input cast is a round trip:
``x.to(float32)`` copies a bf16 activation to fp32, and autocast casts it straight back to bf16 for the adapter's
GEMM. :func:`bind_autocast_lora_inputs` skips that cast exactly when it is one (autocast on, the input already in
autocast's dtype, a vanilla adapter): bit for bit PEFT's forward and gradients, without two passes over each
adapted layer's input a call. In the whole Qwen3.6-27B's full-mode prompt backward the casts were about 4,000
copy kernels per recomputed segment (``bench/results/full_model_qwen3.6-27b_h200_P131072_segment-profile.json``).

One exception reaches the passes that train: LoRA on a MoE block's fused 3-D expert weights (PEFT's
``ParamWrapper``). PEFT forms every expert's adapted weight in each forward; :func:`bind_expert_adapters` (the
trainer binds it for good) applies the low-rank factors to the activations instead, in every pass, equal to
PEFT's forward and gradients in fp32 (:func:`_expert_lora_forward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import LongStrawError


def _adapter_parameters(model: nn.Module) -> Iterator[tuple[nn.Parameter, torch.dtype]]:
    """``(parameter, base dtype)`` for each adapter parameter whose dtype differs from its base layer's."""
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            continue
        for name in ("lora_A", "lora_B"):
            adapters = getattr(module, name, None)
            if not isinstance(adapters, nn.ModuleDict):
                continue
            for param in adapters.parameters():
                # FSDP2's shards (DTensors): its mixed precision hands the layer its compute dtype at each
                # all-gather. Casting a shard would also make FSDP2 take the cast dtype for the parameter's own (it
                # reads it lazily, at the first forward: the capture) and hand the fp32 master a bf16 gradient
                if isinstance(param, DTensor):
                    continue
                if param.is_floating_point() and param.dtype != weight.dtype:
                    yield param, weight.dtype


def _fusable_adapter(module: nn.Module) -> str | None:
    """The one active adapter of a plain PEFT LoRA ``Linear`` (see the module docstring), else ``None``."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft: nothing is fused
        return None
    if type(module) is not LoraLinear or module.disable_adapters or module.merged:
        return None
    if "forward" in module.__dict__ or not isinstance(module.base_layer, nn.Linear):
        return None  # a forward already bound on the instance (an accelerate hook): leave it alone
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1 or getattr(module, "fan_in_fan_out", False):
        return None
    name = active[0]
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    if name in getattr(module, "lora_variant", {}) or not isinstance(module.lora_dropout[name], nn.Identity):
        return None
    if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)) or lora_b.bias is not None:
        return None
    return name


def _fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A plain LoRA ``Linear``: the update accumulated into the base output by one GEMM, in place without autograd
    (adapters in the output's dtype), otherwise out of place (``torch.addmm``, differentiable). Under autograd the
    scale goes with the ``[T, r]`` operand's gradient, not over the ``[T, out]`` output as PEFT's ``* scaling`` and
    its backward do."""
    name = self._longstraw_fused_adapter
    # adapter_names (mixed batches) or variant keywords, or the adapters switched since the binding (a reference pass
    # with them disabled, another adapter made active): PEFT's own forward
    if args or kwargs or self.disable_adapters or self.merged or list(self.active_adapters) != [name]:
        return type(self).forward(self, x, *args, **kwargs)
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    result = self.base_layer(x)
    # PEFT's input cast (a round trip skipped under autocast where `bind_autocast_lora_inputs` bound it)
    update = torch.nn.functional.linear(self._cast_input_dtype(x, lora_a.dtype), lora_a)
    autocast = torch.is_autocast_enabled(result.device.type)
    if update.dtype != result.dtype or (lora_b.dtype != result.dtype and not autocast):
        # mixed dtypes (adapters left in fp32, no autocast): PEFT's forward
        return type(self).forward(self, x)
    flat, low = result.view(-1, result.shape[-1]), update.view(-1, update.shape[-1])
    if not torch.is_grad_enabled() and lora_b.dtype == result.dtype:
        flat.addmm_(low, lora_b.t(), alpha=self.scaling[name])
        return result
    # under autograd, or fp32 adapters under autocast (which casts them): out of place, the same call with or without
    # a graph, so that a scoring pass gets the replay's values
    return torch.addmm(flat, low, lora_b.t(), alpha=self.scaling[name]).view(result.shape)


# the expert weights a MoE experts module of transformers v5 multiplies by (`use_experts_implementation`)
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
_EXPERT_ATTRIBUTES = (
    "num_experts",
    "has_gate",
    "has_bias",
    "is_transposed",
    "has_post_expert_norm",
    "_apply_gate",
)


def _expert_adapters(module: nn.Module) -> list[tuple[nn.Module, str]] | None:
    """For a PEFT ``ParamWrapper`` over a transformers-v5 MoE experts module (the outermost of a nested chain),
    its chain of wrappers with their one active adapter each (``[(wrapper, adapter name)]``, outermost first)
    as they stand now (adapters enabled, not merged), else ``None``.

    PEFT adapts each fused 3-D expert weight ``W [E, ., .]`` by a ``ParamWrapper`` whose forward forms
    ``W + scaling * lhs @ rhs`` for every expert before the experts run (one wrapper a weight, nested). In a
    decode step of the GLM-5 slice that rebuilt both MoE layers' expert stacks, 146-152 ms a step against 2.8
    without LoRA (docs/guide.md, "Supported models"). :func:`_expert_lora_forward` multiplies the activations by the factors
    instead."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
        from transformers.integrations import moe  # noqa: F401 - the grouped GEMMs it uses
    except ImportError:
        return None
    if type(module) is not ParamWrapper:
        return None
    chain, layer = [], module
    while type(layer) is ParamWrapper:
        if layer.disable_adapters or layer.merged or getattr(layer, "num_experts", 1) <= 1:
            return None
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) != 1 or layer.parameter_name not in _EXPERT_WEIGHTS:
            return None
        chain.append((layer, active[0]))
        layer = layer.base_layer
    experts = layer
    if not all(hasattr(experts, a) for a in _EXPERT_ATTRIBUTES) or getattr(
        experts, "_is_expert_parallel", False
    ):
        return None
    if experts.has_post_expert_norm or experts.has_bias:  # (not needed by any patched family yet)
        return None
    return chain


def _expert_linear(x, weight, factors, offsets, transposed: bool) -> torch.Tensor:
    """``x`` times each token's expert weight ``W + scaling * lhs @ rhs`` (grouped by expert), the low-rank part
    through the activations: ``x (lhs rhs)`` or ``x (lhs rhs)^T``, never the product itself."""
    from transformers.integrations.moe import _grouped_linear, _grouped_mm

    out = _grouped_linear(x, weight, offsets, is_transposed=transposed)
    if factors is None:
        return out
    lhs, rhs, scaling = factors
    # W [E, in, out] = P + s lhs rhs (transposed layout), else W [E, out, in] and x W^T = x P^T + s (x rhs^T) lhs^T
    first, second = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
    # grouped GEMMs want rows of a multiple of 16 bytes: the rank padded with zeros to a multiple of 16
    pad = -first.shape[-1] % 16
    first = torch.nn.functional.pad(first, (0, pad)).contiguous()
    second = torch.nn.functional.pad(second, (0, 0, 0, pad)).contiguous()
    low = _grouped_mm(_grouped_mm(x, first, offsets), second, offsets)
    return out.add_(low.to(out.dtype), alpha=scaling)


def _expert_lora_forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """The experts of a MoE block with LoRA on their fused weights, without forming the adapted weights: the
    grouped form of transformers' ``grouped_mm_experts_forward`` (tokens sorted by expert, one grouped GEMM a
    projection, no host sync, so a decode step stays one CUDA graph) with each adapter's low-rank factors
    applied to the activations (:func:`_expert_linear`); differentiable, so replays train through it. Bound on
    the outermost ``ParamWrapper``; with its adapters disabled, merged or several active, PEFT's forward runs."""
    chain = _expert_adapters(self)
    if chain is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    experts = chain[-1][0].base_layer
    factors = {w.parameter_name: w.get_delta_factors(name) for w, name in chain}
    k, hidden = top_k_index.size(-1), hidden_states.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // k]
    weights = top_k_weights.reshape(-1)[perm]
    counts = torch.histc(
        expert_ids.float() if x.device.type in ("cpu", "mps") else expert_ids.int(),
        bins=experts.num_experts,
        min=0,
        max=experts.num_experts - 1,
    )
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    h = _expert_linear(x, getattr(experts, up), factors.get(up), offsets, experts.is_transposed)
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    h = _expert_linear(h, experts.down_proj, factors.get("down_proj"), offsets, experts.is_transposed)
    h = h * weights.unsqueeze(-1)
    out = torch.empty_like(h)
    out[perm] = h  # back to (token, slot) order
    return out.view(-1, k, hidden).sum(dim=1).to(hidden_states.dtype)


def _unbound_expert_chains(model: nn.Module) -> list[nn.Module]:
    """The outermost ``ParamWrapper`` of each expert chain :func:`_expert_lora_forward` serves now, that has no
    forward bound on it yet (by :func:`bind_expert_adapters`, or an accelerate hook)."""
    inner = {id(m.base_layer) for m in model.modules() if type(m).__name__ == "ParamWrapper"}
    return [
        m
        for m in model.modules()
        if id(m) not in inner and "forward" not in m.__dict__ and _expert_adapters(m) is not None
    ]


@contextlib.contextmanager
def fused_lora_forwards(
    model: nn.Module, enabled: bool = True, differentiable: bool = False
) -> Iterator[int]:
    """Inside the block, plain LoRA layers add their update in one GEMM epilogue, and LoRA on MoE experts' fused
    weights multiplies the activations by its factors (:func:`_expert_lora_forward`). Yields how many modules were
    changed; each gets PEFT's forward back afterwards. Graph-free only, unless ``differentiable``: then calls under
    autograd take the epilogue too (an out-of-place ``addmm``; the training replays and the prompt backward, whose
    checkpointed recomputes must run inside the same block). Modules an enclosing block bound keep its forward."""
    if not enabled:
        yield 0
        return
    if torch.is_grad_enabled() and not differentiable:
        raise LongStrawError("fused_lora_forwards is for graph-free passes: enter it under torch.no_grad()")
    fused = []
    try:
        for module in model.modules():
            name = _fusable_adapter(module)
            if name is not None:
                module._longstraw_fused_adapter = name
                module.forward = _fused_lora_forward.__get__(module)
                fused.append((module, "_longstraw_fused_adapter"))
        for module in _unbound_expert_chains(model):
            module.forward = _expert_lora_forward.__get__(module)
            fused.append((module, None))
        yield len(fused)
    finally:
        for module, attr in fused:
            delattr(module, "forward")
            if attr is not None:
                delattr(module, attr)


def _vanilla_lora_linear(module: nn.Module) -> bool:
    """A PEFT LoRA ``Linear`` whose adapters are all vanilla (no variant such as DoRA) without dropout."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # no peft: nothing to bind
        return False
    if not isinstance(module, LoraLinear) or getattr(module, "lora_variant", None):
        return False
    return all(isinstance(d, nn.Identity) for d in module.lora_dropout.values()) and all(
        isinstance(a, nn.Linear) for a in module.lora_A.values()
    )


def _cast_input_unless_autocast(self, x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """PEFT's cast of a LoRA layer's input to its adapter's dtype, skipped when it is a round trip: autocast is
    on and the input is already in autocast's dtype, so the adapter's ``F.linear`` would cast the fp32 copy
    straight back (forward and gradients are bit for bit the same; a bf16 -> fp32 -> bf16 cast is exact)."""
    if x is not None and x.dtype != dtype and dtype == torch.float32:
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.dtype == torch.get_autocast_dtype(device):
            return x
    return type(self)._cast_input_dtype(self, x, dtype)


def bind_autocast_lora_inputs(model: nn.Module) -> int:
    """Bind :func:`_cast_input_unless_autocast` as ``_cast_input_dtype`` of every vanilla PEFT LoRA ``Linear`` of
    ``model`` (idempotent; bound per instance, so ``deepcopy`` rebinds it). Returns how many layers it bound."""
    bound = 0
    for module in model.modules():
        if "_cast_input_dtype" not in module.__dict__ and _vanilla_lora_linear(module):
            module._cast_input_dtype = _cast_input_unless_autocast.__get__(module)
            bound += 1
    return bound


def bind_expert_adapters(model: nn.Module) -> int:
    """Run every PEFT ``ParamWrapper`` chain over a MoE experts module through :func:`_expert_lora_forward`
    from now on, in every pass (the trainer does this to its models): the adapted expert weights are never
    formed, and capture, decoding, scoring and replays (forward and backward, checkpoint recompute included)
    take the same path. It equals PEFT's forward and its gradients in fp32 (``tests/test_adapters.py``); in bf16
    it also keeps an update that PEFT's merged weight would round away. Returns how many chains were bound."""
    chains = _unbound_expert_chains(model)
    for module in chains:
        module.forward = _expert_lora_forward.__get__(module)
    return len(chains)


@contextlib.contextmanager
def adapters_in_model_dtype(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Inside the block, adapter parameters hold copies in their base layer's dtype (graph-free only), and plain
    LoRA layers add their update in the base GEMM's epilogue (:func:`fused_lora_forwards`).

    Yields how many parameters were cast. Nothing changes for a model without adapters, with adapters
    already in the model's dtype, on fp32 models, or when ``enabled`` is False.
    """
    if not enabled:
        yield 0
        return
    if torch.is_grad_enabled():
        raise LongStrawError(
            "adapters_in_model_dtype is for graph-free passes: enter it under torch.no_grad()"
        )
    originals = []
    try:
        for param, dtype in _adapter_parameters(model):
            originals.append((param, param.data))
            param.data = param.data.to(dtype)
        with fused_lora_forwards(model):
            yield len(originals)
    finally:
        for param, data in originals:
            param.data = data
