"""Fused elementwise forwards of HF's norm and MLP modules: graph-free passes (capture, generation, extend), and,
with ``differentiable=True``, passes that are differentiated (training replays, the prompt backward's recompute).

Hugging Face's RMSNorm modules run ten or so small kernels each (``Qwen3_5RMSNorm``: ``x.float()``, ``pow``,
``mean``, ``+ eps``, ``rsqrt``, ``*``, ``w.float()``, ``1 + w``, ``*``, ``type_as``), the gated norm of the Gated
DeltaNet layers twelve, the MLP's ``act_fn(gate) * up`` two: in a decode step (one CUDA graph of a few small
kernels per op) and in a capture (as many passes over an fp32 copy of the activations) they are most of what
runs besides the GEMMs and attention. The training replays and the full-gradient prompt backward run the same
chains under autograd (HF's / our activation checkpointing runs each segment's forward twice), plus their autograd
backward: as many small kernels again, and the fp32 intermediates they save. Inside
:func:`fused_elementwise_forwards` each such module whose class is known runs one Triton kernel instead
(``longstraw_trl.kernels.elementwise``), with HF's cast points: the outputs match HF's up to the summation order
of the mean and the last bits of ``exp`` (at most one unit in the last place of the activation dtype; most are
bit-identical). With ``differentiable=True`` a call under autograd runs the same forward kernel as an autograd
function that saves only its inputs and has one backward kernel (``rms_norm_fn`` and the like): the gradients
are those of HF's fp32 math, rounded once to the inputs' dtypes (autograd through HF's forward rounds some
intermediate gradients to the activation dtype as well).

A class is served only if it is one of the exact HF classes listed here (by module and name: a subclass or a
look-alike keeps its forward), its instance has the attributes the kernel reads (an ``eps`` / ``variance_epsilon``
number, a 1-D ``weight``; a SiLU ``act_fn``), and its stock forward computes the kernel's math: once per class, its
forward is run on a tiny CPU probe in bfloat16 and must equal the kernel's torch reference bit for bit (a new
transformers release that changes the math, or a class registered under the wrong variant, is left alone).

The forwards are bound on the instances (``module.forward``, as :func:`longstraw_trl.adapters.fused_lora_forwards`
does) and removed on exit. A call on a CPU tensor, with inputs the kernels do not take, or (unless
``differentiable``) with autograd enabled runs the stock forward; on a model on the CPU (or without Triton)
nothing is bound. A checkpointed segment's backward recomputes its forward: with ``differentiable=True``, run
that backward inside the block too, so that the recompute runs the forwards that the first pass ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers.activations import SiLUActivation

from longstraw_trl.adapters import fused_lora_forwards
from longstraw_trl.kernels.elementwise import (
    RMSNormVariant,
    elementwise_available,
    gated_rms_norm,
    gated_rms_norm_fn,
    naive_gated_rms_norm,
    naive_rms_norm,
    naive_silu_mul,
    rms_norm,
    rms_norm_available,
    rms_norm_fn,
    silu_mul,
    silu_mul_fn,
)

_M = "transformers.models"

# RMSNorm classes by variant (HF's forwards: see kernels/elementwise/naive.py).
_NORMS: dict[str, RMSNormVariant] = {
    **{
        f"{_M}.{family}.modeling_{family}.{name}": "zero_centered"
        for family, name in (
            ("qwen3_5", "Qwen3_5RMSNorm"),
            ("qwen3_5_moe", "Qwen3_5MoeRMSNorm"),
            ("qwen3_next", "Qwen3NextRMSNorm"),
            ("gemma2", "Gemma2RMSNorm"),
            ("gemma3", "Gemma3RMSNorm"),
        )
    },
    **{
        f"{_M}.{family}.modeling_{family}.{name}": "llama"
        for family, name in (
            ("llama", "LlamaRMSNorm"),
            ("mistral", "MistralRMSNorm"),
            ("ministral", "MinistralRMSNorm"),
            ("qwen2", "Qwen2RMSNorm"),
            ("qwen3", "Qwen3RMSNorm"),
            ("qwen3_moe", "Qwen3MoeRMSNorm"),
            ("glm4_moe", "Glm4MoeRMSNorm"),
            ("glm_moe_dsa", "GlmMoeDsaRMSNorm"),
            ("deepseek_v32", "DeepseekV32RMSNorm"),
        )
    },
    f"{_M}.gpt_oss.modeling_gpt_oss.GptOssRMSNorm": "gpt_oss",
}
# Gated RMSNorm of the Gated DeltaNet layers (one math in all three families).
_GATED_NORMS = frozenset(
    f"{_M}.{family}.modeling_{family}.{name}"
    for family, name in (
        ("qwen3_5", "Qwen3_5RMSNormGated"),
        ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated"),
        ("qwen3_next", "Qwen3NextRMSNormGated"),
    )
)
# MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x)) (served when act_fn is SiLU).
_MLPS = frozenset(
    f"{_M}.{family}.modeling_{family}.{name}"
    for family, name in (
        ("llama", "LlamaMLP"),
        ("mistral", "MistralMLP"),
        ("ministral", "MinistralMLP"),
        ("qwen2", "Qwen2MLP"),
        ("qwen3", "Qwen3MLP"),
        ("qwen3_moe", "Qwen3MoeMLP"),
        ("qwen3_5", "Qwen3_5MLP"),
        ("qwen3_5_moe", "Qwen3_5MoeMLP"),
        ("qwen3_next", "Qwen3NextMLP"),
        ("glm4_moe", "Glm4MoeMLP"),
        ("glm_moe_dsa", "GlmMoeDsaMLP"),
        ("deepseek_v32", "DeepseekV32MLP"),
        ("cohere2", "Cohere2MLP"),
        ("gemma2", "Gemma2MLP"),
        ("gemma3", "Gemma3MLP"),
    )
)
_EPS_NAMES = ("variance_epsilon", "eps")
# The bound module's (variant, differentiable): its RMSNorm variant (None for the others) and whether calls under
# autograd run the kernels too.
_ATTR = "_longstraw_fused_elementwise"


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _eps(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _is_silu(act: object) -> bool:
    return type(act) in (SiLUActivation, nn.SiLU)


def _stock(self, args: tuple, kwargs: dict) -> torch.Tensor:
    return type(self).forward(self, *args, **kwargs)


def _graph(self) -> bool | None:
    """Whether this call builds a graph (True), is graph-free (False), or is the stock forward's (None: autograd
    on, and the module bound without ``differentiable``)."""
    if not torch.is_grad_enabled():
        return False
    return True if getattr(self, _ATTR)[1] else None


def _fused_norm_forward(self, *args, **kwargs) -> torch.Tensor:
    """An RMSNorm in one kernel (CUDA, one positional input; graph-free, or differentiable when bound so);
    otherwise the stock forward."""
    eps = _eps(self)
    graph = _graph(self)
    if (
        len(args) != 1
        or kwargs
        or eps is None
        or graph is None
        or not rms_norm_available(args[0], self.weight)
    ):
        return _stock(self, args, kwargs)
    variant = getattr(self, _ATTR)[0]
    return (rms_norm_fn if graph else rms_norm)(args[0], self.weight, eps, variant)


def _fused_gated_norm_forward(self, *args, **kwargs) -> torch.Tensor:
    """A gated RMSNorm in one kernel (CUDA, ``(hidden_states, gate)`` positional; graph-free, or differentiable
    when bound so); otherwise the stock forward."""
    eps = _eps(self)
    graph = _graph(self)
    if len(args) != 2 or kwargs or eps is None or graph is None:
        return _stock(self, args, kwargs)
    x, gate = args
    if not (isinstance(gate, torch.Tensor) and gate.shape == x.shape and elementwise_available(gate)):
        return _stock(self, args, kwargs)
    if not rms_norm_available(x, self.weight):
        return _stock(self, args, kwargs)
    return (gated_rms_norm_fn if graph else gated_rms_norm)(x, gate, self.weight, eps)


def _fused_mlp_forward(self, *args, **kwargs) -> torch.Tensor:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the activation and product in one kernel (graph-free,
    or differentiable when bound so)."""
    graph = _graph(self)
    if (
        len(args) != 1
        or kwargs
        or graph is None
        or not elementwise_available(args[0])
        or not _is_silu(self.act_fn)
    ):
        return _stock(self, args, kwargs)
    gate, up = self.gate_proj(args[0]), self.up_proj(args[0])
    if gate.shape != up.shape or not elementwise_available(
        gate, up
    ):  # e.g. fp64 projections: HF's expression
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj((silu_mul_fn if graph else silu_mul)(gate, up))


# The probe of each class's math (see the module docstring): class -> whether its forward is the kernel's math.
_MATH_CHECKED: dict[type, bool] = {}


def _probe_instance(module: nn.Module) -> nn.Module:
    """An uninitialised instance of ``module``'s class with its plain attributes (``eps``, ``activation``, ...)."""
    cls = type(module)
    probe = cls.__new__(cls)
    nn.Module.__init__(probe)
    for name, value in vars(module).items():
        if not name.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module)):
            setattr(probe, name, value)
    return probe


def _math_matches(module: nn.Module, kind: str, variant: RMSNormVariant | None) -> bool:
    cls = type(module)
    if cls in _MATH_CHECKED:
        return _MATH_CHECKED[cls]
    dim, hidden, dtype = 16, 24, torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    probe = _probe_instance(module)
    x = randn(4, dim, scale=3.0)
    try:
        # nn.Linear initialises from the global generator: leave the caller's random stream as it was
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            if kind == "mlp":
                probe.gate_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
                probe.up_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
                probe.down_proj = nn.Linear(hidden, dim, bias=False, dtype=dtype)
                for linear in (probe.gate_proj, probe.up_proj, probe.down_proj):
                    linear.weight.copy_(randn(*linear.weight.shape, scale=0.3))
                probe.act_fn = type(module.act_fn)()
                stock = cls.forward(probe, x)
                expected = probe.down_proj(naive_silu_mul(probe.gate_proj(x), probe.up_proj(x)))
            else:
                probe.weight = nn.Parameter(randn(dim, scale=0.5))
                eps = _eps(probe)
                if kind == "gated":
                    gate = randn(4, dim, scale=2.0)
                    stock = cls.forward(probe, x, gate)
                    expected = naive_gated_rms_norm(x, gate, probe.weight, eps)
                else:
                    stock = cls.forward(probe, x)
                    expected = naive_rms_norm(x, probe.weight, eps, variant)
        ok = stock.dtype == expected.dtype and torch.equal(stock, expected)
    except Exception:  # noqa: BLE001 - a forward that does not run on the probe is not the kernel's math
        ok = False
    _MATH_CHECKED[cls] = ok
    return ok


def _fusion(module: nn.Module) -> tuple[str, RMSNormVariant | None] | None:
    """``(kind, variant)`` of a module the kernels serve, else ``None`` (see the module docstring)."""
    if "forward" in module.__dict__:
        return None  # a forward already bound on the instance (an accelerate hook, a fused forward): leave it
    name = _class_name(type(module))
    variant = None
    if name in _NORMS or name in _GATED_NORMS:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or _eps(module) is None:
            return None
        if name in _GATED_NORMS and getattr(module, "activation", None) != "silu":
            return None
        kind, variant = ("gated", None) if name in _GATED_NORMS else ("norm", _NORMS[name])
        on_device = elementwise_available(weight)
    elif name in _MLPS:
        projections = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Module) for p in projections) or not _is_silu(
            getattr(module, "act_fn", None)
        ):
            return None
        weight = getattr(projections[0], "weight", None)
        kind, on_device = "mlp", isinstance(weight, torch.Tensor) and elementwise_available(weight)
    else:
        return None
    if not on_device or not _math_matches(module, kind, variant):
        return None
    return kind, variant


_FORWARDS = {"norm": _fused_norm_forward, "gated": _fused_gated_norm_forward, "mlp": _fused_mlp_forward}


@contextlib.contextmanager
def fused_elementwise_forwards(
    model: nn.Module, enabled: bool = True, differentiable: bool = False
) -> Iterator[dict[str, int]]:
    """Inside the block, HF's RMSNorm, gated RMSNorm and SiLU-MLP modules of ``model`` run fused Triton kernels
    (on CUDA; see the module docstring); each gets its stock forward back afterwards.

    Yields how many modules of each kind (``"norm"``, ``"gated"``, ``"mlp"``) were bound: none on a CPU model,
    without Triton, or when ``enabled`` is False. Calls under autograd run the stock forwards unless
    ``differentiable``: then they run the kernels too, as autograd functions with one backward kernel each
    (dweight only for a weight that requires grad), since the replays and the prompt backward's checkpointed
    segments otherwise run HF's chains of small kernels, twice with the recompute, and their autograd backward.

    Nested blocks leave the modules an outer block bound as it bound them (an inner exit must not take the outer
    block's forwards away: a checkpointed segment's backward would then recompute with other forwards).
    """
    counts = dict.fromkeys(_FORWARDS, 0)
    if not enabled:
        yield counts
        return
    bound = []
    try:
        for module in model.modules():
            if hasattr(module, _ATTR):  # bound by an enclosing block: its binding stands
                continue
            fusion = _fusion(module)
            if fusion is None:
                continue
            kind, variant = fusion
            setattr(module, _ATTR, (variant, differentiable))
            module.forward = _FORWARDS[kind].__get__(module)
            bound.append(module)
            counts[kind] += 1
        yield counts
    finally:
        for module in bound:
            del module.forward
            delattr(module, _ATTR)


@contextlib.contextmanager
def replay_forwards(model: nn.Module, enabled: bool = True, differentiable: bool = False) -> Iterator[None]:
    """The forwards the training replays run (``autograd_fused_kernels``): HF's norm and MLP modules through the fused
    kernels (:func:`fused_elementwise_forwards`) and plain LoRA layers' update in their base GEMM's epilogue
    (:func:`~longstraw_trl.adapters.fused_lora_forwards`). One place for both, so that a graph-free scoring pass (old
    and reference log-probs) and a replay under autograd (``differentiable``) run the same forwards: the first
    iteration's old log-probs then equal its replay's bit for bit, as in stock TRL."""
    with (
        fused_elementwise_forwards(model, enabled, differentiable),
        fused_lora_forwards(model, enabled, differentiable),
    ):
        yield
