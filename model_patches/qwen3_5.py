"""Qwen3.5 / Qwen3.6 hybrids: ``qwen3_5`` and ``qwen3_5_moe`` (text model and the language model of
``*ForConditionalGeneration``), Gated DeltaNet layers interleaved with gated full attention.

This module also holds the Gated DeltaNet (GDN) replay shared by every HF family built on the same layer
(``qwen3_next`` subclasses :class:`GatedDeltaNetHybridPatch` and only changes the input projections).

Full-attention layers need nothing here: HF's ``Qwen3_5Attention`` keeps its own projections, q/k norms,
partial rotary and output gate, and calls the attention interface, which the engine dispatches to the
prompt pages when its context is passed down.

GDN layers: the decoder layer forwards its extra keywords to ``linear_attn``, so :meth:`apply` wraps the
GDN class's ``forward`` once (class level, like HF's own checkpointing wrapper, so accelerate hooks,
``deepcopy`` and peft keep working). Without the engine's keyword the stock forward runs untouched. With
it, :func:`gdn_forward` reuses the module's own submodules (projections, conv weight, gated RMSNorm,
``out_proj``: LoRA on them applies) and replaces only the state handling and the kernels:

- ``capture``: the chunk continues from ``state.layers[i]`` (a :class:`GDNState`, fixed size), which then
  takes the new tensors (rebound, never written in place, so forks and earlier states stay valid);
- ``replay``: the prompt state, expanded to the batch, is a read-only constant (no gradient reaches it),
  or, for the full gradient (``ctx.grads``), a leaf whose gradient the engine carries back;
- ``segment`` (the full gradient's reverse recompute): as replay, from the state at the segment's start, and
  the state after it goes to the engine (``ctx.emit_state``) with the gradient the next segment sent it;
- ``decode``: the G sequences' states live in ``ctx.running[i]``, started from the prompt state; after
  each call they are rebound, or, when decoding with fixed shapes (``ctx.step``, CUDA graphs), updated in
  place; the prompt state is not touched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from longstraw_trl.context import CTX_KWARG
from longstraw_trl.errors import LongStrawError
from longstraw_trl.kernels.causal_conv1d import causal_conv1d_with_state
from longstraw_trl.kernels.gated_delta_rule import gated_delta_rule, gdn_decode_available, gdn_decode_step
from longstraw_trl.layer_state import ConvRecurrentState, KVPages, LayerState

from .base import FamilyPatch
from .planned_bytes import attention_graph_bytes, mlp_graph_bytes

LINEAR, FULL = "linear_attention", "full_attention"
_CONV_ACTIVATIONS = ("silu", "swish")

# (mixed_qkv [B, T, 2 * key_dim + value_dim], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv])
Projection = Callable[
    [nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
]


# ----------------------------------------------------------------------------------------------------
# Gated DeltaNet state and replay (shared by every family with HF's Qwen3.5 / Qwen3-Next GDN layer)
# ----------------------------------------------------------------------------------------------------
class GDNState(ConvRecurrentState):
    """Gated DeltaNet state of one linear-attention layer at the prompt boundary (a :class:`ConvRecurrentState`).

    ``conv`` holds the last ``kernel_size - 1`` pre-convolution inputs ``[B, C, kernel_size - 1]`` and
    ``recurrent`` the delta-rule state ``[B, H, K, V]`` (fp32); ``B`` is 1 for a prompt, G while decoding.
    """

    kind = "gdn"

    @classmethod
    def planned_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        conv = (2 * hk * dk + hv * dv) * (config.linear_conv_kernel_dim - 1) * dtype_bytes
        return conv + hv * dk * dv * 4  # the recurrent state is fp32


def gdn_graph_bytes(config, b: int) -> int:
    """The planner's formula: per token, what autograd keeps for one Gated DeltaNet mixer: the norm's input and
    output, the projections, the conv's input and output, the gate ``z`` and the gated norm; the chunked delta rule
    keeps about 6x its fp32 inputs (q and k repeated to the value heads) and one ``[Hv, K, V]`` fp32 state per
    64-token chunk."""
    h = config.hidden_size
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv
    rule = 6 * (2 * hv * dk + hv * dv) * 4 + hv * dk * dv * 4 // 64
    return (2 * h + 3 * conv_dim + 3 * hv * dv) * b + rule


def gdn_forward(module: nn.Module, hidden_states: torch.Tensor, ctx, project: Projection) -> torch.Tensor:
    """HF's ``*GatedDeltaNet.forward`` continuing from (and, per ``ctx.mode``, producing) a GDN state.

    Same math, dtypes and submodules as the stock layer; only the conv / recurrent state handling and
    the kernel calls differ (:func:`causal_conv1d_with_state`, :func:`gated_delta_rule`).
    """
    idx = module.layer_idx
    batch, seq_len, _ = hidden_states.shape
    mixed_qkv, z, b, a = project(module, hidden_states)
    start = ctx.recurrent_start(idx, GDNState, batch)
    if (
        ctx.decoding
        and seq_len == 1
        and gdn_decode_available(mixed_qkv, a, b, module.conv1d.weight, start.conv, start.recurrent)
    ):
        core = _fused_decode(module, ctx, idx, mixed_qkv, a, b, start)
        return _output(module, core, z)

    conv_out, conv_state = causal_conv1d_with_state(
        mixed_qkv.transpose(1, 2),
        module.conv1d.weight,
        module.conv1d.bias,
        conv_state=start.conv,
        activation=module.activation,
        state_grad=ctx.state_grad,
    )
    query, key, value = torch.split(
        conv_out.transpose(1, 2), [module.key_dim, module.key_dim, module.value_dim], dim=-1
    )
    query = query.reshape(batch, seq_len, -1, module.head_k_dim)
    key = key.reshape(batch, seq_len, -1, module.head_k_dim)
    value = value.reshape(batch, seq_len, -1, module.head_v_dim)

    beta = b.sigmoid()
    # as HF: in fp32, so that an fp16 A_log cannot overflow
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)

    keep = ctx.mode.needs_final_state
    core, recurrent = gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        initial_state=start.recurrent,
        output_final_state=keep,
        use_qk_l2norm_in_kernel=True,
        state_grad=ctx.state_grad,
    )
    if keep:
        ctx.keep_final_state(idx, GDNState(conv_state, recurrent))
    return _output(module, core, z)


def _output(module: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated RMSNorm and ``out_proj`` of the core output ``[B, T, Hv, Dv]``."""
    batch, seq_len = core.shape[:2]
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(batch, seq_len, -1))


def _fused_decode(module: nn.Module, ctx, idx: int, mixed_qkv, a, b, start: GDNState) -> torch.Tensor:
    """One decode token through :func:`gdn_decode_step` (conv, gating and delta rule in two kernels). With
    fixed shapes (CUDA graphs) it updates the running state in place; otherwise the state is rebound to new
    tensors, as the torch path does (:meth:`ForwardContext.keep_final_state`)."""
    running = ctx.running.get(idx)
    core, conv_state, recurrent = gdn_decode_step(
        mixed_qkv,
        a,
        b,
        module.conv1d.weight,
        module.conv1d.bias,
        module.A_log,
        module.dt_bias,
        start.conv,
        start.recurrent,
        num_k_heads=module.num_k_heads,
        head_k_dim=module.head_k_dim,
        head_v_dim=module.head_v_dim,
        activation=module.activation,
        in_place=ctx.step is not None and running is not None,
    )
    ctx.keep_final_state(idx, GDNState(conv_state, recurrent))
    return core


def _with_accelerate_hooks(fn: Callable) -> Callable:
    """Fire ``conv1d``'s accelerate hooks around ``fn`` as HF's forward does (its weight is read directly)."""
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except ImportError:  # pragma: no cover - older transformers
        return fn
    return force_accelerate_hooks("conv1d")(fn)


def install_gdn_forward(cls: type[nn.Module], project: Projection, ctx_kwarg: str) -> None:
    """Wrap ``cls.forward`` (idempotent): with ``ctx_kwarg`` run :func:`gdn_forward`, else the stock code."""
    stock = cls.forward
    if getattr(stock, "_longstraw_gdn", False):
        return

    @_with_accelerate_hooks
    def replay(self, hidden_states, ctx, cache_params=None, attention_mask=None):
        if cache_params is not None:
            raise LongStrawError("a LongStraw call cannot also use an HF cache (cache_params)")
        if attention_mask is not None:
            raise LongStrawError("a LongStraw call takes no attention_mask: rows are right-padded instead")
        return gdn_forward(self, hidden_states, ctx, project)

    @functools.wraps(stock)
    def forward(self, hidden_states, *args, **kwargs):
        ctx = kwargs.pop(ctx_kwarg, None)
        if ctx is None:
            return stock(self, hidden_states, *args, **kwargs)
        if args:
            raise LongStrawError(f"{cls.__name__}: pass cache_params / attention_mask by keyword")
        return replay(
            self,
            hidden_states,
            ctx,
            cache_params=kwargs.get("cache_params"),
            attention_mask=kwargs.get("attention_mask"),
        )

    forward._longstraw_gdn = True
    forward._longstraw_stock = stock
    cls.forward = forward


# ----------------------------------------------------------------------------------------------------
# Family patches
# ----------------------------------------------------------------------------------------------------
class GatedDeltaNetHybridPatch(FamilyPatch):
    """Decoder stacks mixing HF's Gated DeltaNet layers (``linear_attn``) with full attention."""

    gdn_attr = "linear_attn"

    def project(self, module: nn.Module, hidden_states: torch.Tensor):
        """The family's input projections: see :data:`Projection`."""
        raise NotImplementedError

    def layer_state_type(self, config, layer_idx: int) -> type[LayerState]:
        return GDNState if config.layer_types[layer_idx] == LINEAR else KVPages

    #: whether the full-attention layers gate their output (``attn_output_gate``), which the planner counts
    gated_attention = True

    def planned_layer_graph_bytes(self, config, kind: str, tokens: int, dtype_bytes: int) -> int:
        """Gated DeltaNet layers by :func:`gdn_graph_bytes`, full attention with its output gate; each with its
        MLP."""
        if kind == LINEAR:
            mixer = gdn_graph_bytes(config, dtype_bytes)
        else:
            mixer = attention_graph_bytes(config, dtype_bytes, gated=self.gated_attention)
        return tokens * (mixer + mlp_graph_bytes(config, dtype_bytes))

    def no_attention_masks(self, model: nn.Module) -> dict:
        # a prepared mapping: HF then builds no causal or recurrent masks (the GDN replay refuses masks)
        return {FULL: None, LINEAR: None}

    def gdn_modules(self, model: nn.Module) -> list[nn.Module]:
        return [
            getattr(layer, self.gdn_attr)
            for layer in self.decoder(model).layers
            if getattr(layer, self.gdn_attr, None) is not None
        ]

    def validate(self, model: nn.Module) -> None:
        config = self.text_config(model)
        layer_types = list(getattr(config, "layer_types", None) or [])
        other = sorted(set(layer_types) - {LINEAR, FULL})
        if other:
            raise self.unsupported(f"layer types {other} (only {LINEAR!r} and {FULL!r} are)")
        self.validate_common(config)
        if LINEAR in layer_types:
            act = getattr(config, "hidden_act", None)
            if act not in _CONV_ACTIVATIONS:
                raise self.unsupported(f"hidden_act={act!r} for the Gated DeltaNet conv (only silu is)")
            hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
            if hv % hk:
                raise self.unsupported(
                    f"linear_num_value_heads={hv} not a multiple of linear_num_key_heads={hk}"
                )
        for module in self.gdn_modules(model):
            if not hasattr(module, "conv1d") or not hasattr(module, "A_log"):
                raise self.unsupported(f"a Gated DeltaNet layer of type {type(module).__name__}")

    def apply(self, model: nn.Module) -> None:
        for cls in {type(m) for m in self.gdn_modules(model)}:
            install_gdn_forward(cls, self.project, CTX_KWARG)


class Qwen3_5Patch(GatedDeltaNetHybridPatch):
    """``qwen3_5`` / ``qwen3_5_moe``: ``*ForCausalLM`` and the language model of ``*ForConditionalGeneration``.

    Text only: image / video inputs are not captured (their tokens would be embedded as plain text).
    """

    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

    def decoder(self, model: nn.Module) -> nn.Module:
        inner = model.model
        return getattr(inner, "language_model", inner)  # ForConditionalGeneration -> its text model

    def position_ids(self, start, length: int, batch: int, device: torch.device) -> torch.Tensor:
        """The three mrope rows (temporal, height, width) the rotary embedding takes; equal for text."""
        pos = torch.arange(length, device=device) + start
        return pos.view(1, 1, length).expand(3, batch, length)

    def project(self, module: nn.Module, hidden_states: torch.Tensor):
        batch, seq_len, _ = hidden_states.shape
        mixed_qkv = module.in_proj_qkv(hidden_states)
        z = module.in_proj_z(hidden_states).reshape(batch, seq_len, -1, module.head_v_dim)
        return mixed_qkv, z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
