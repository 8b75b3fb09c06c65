"""Nemotron-H (``nemotron_h``: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): Mamba-2 layers interleaved with
attention, MLP and MoE blocks (``config.layers_block_type``, or the pattern ``hybrid_override_pattern``: ``M``
Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE). Each block holds one mixer.

Attention blocks need nothing here: ``NemotronHAttention`` (no positional encoding) calls the attention interface,
which the engine dispatches to the prompt pages. MLP and MoE blocks keep no state.

Mamba-2 blocks: :meth:`NemotronHPatch.apply` binds :func:`mixer_forward` to each ``NemotronHMamba2Mixer`` instance
(Liger-Kernel style, ``__get__``: ``deepcopy`` rebinds it). Without the engine's keyword it runs the stock forward
untouched. With it, :func:`mamba2_forward` reuses the module's own submodules (``in_proj``, the conv weight, the
gated group RMSNorm, ``out_proj``: LoRA on them applies) and replaces only the state handling and the scan, as the
Gated DeltaNet replay does (:mod:`.qwen3_5`): the state is a :class:`Mamba2State` (conv + SSM state, a
:class:`~longstraw_trl.layer_state.ConvRecurrentState`), and what each mode reads and writes is the context's
(``recurrent_start`` / ``keep_final_state``): capture rebinds the prompt state chunk by chunk, replay reads it as a
constant, decode keeps the G sequences' running state, the full gradient's segments start from leaves and emit the
state after them.
"""

from __future__ import annotations

import torch
from torch import nn

from longstraw_trl.context import CTX_KWARG
from longstraw_trl.errors import LongStrawError
from longstraw_trl.kernels.causal_conv1d import causal_conv1d_with_state
from longstraw_trl.kernels.mamba2 import mamba2_scan
from longstraw_trl.layer_state import ConvRecurrentState, KVPages, LayerState

from .base import FamilyPatch

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_CONV_ACTIVATIONS = ("silu", "swish")


class Mamba2State(ConvRecurrentState):
    """Mamba-2 state of one layer at the prompt boundary: ``conv`` ``[B, conv_dim, conv_kernel - 1]`` (the last
    inputs of the conv over ``x, B, C``; ``conv_dim = mamba_num_heads * mamba_head_dim + 2 * n_groups *
    ssm_state_size``) and ``recurrent`` the SSM state ``[B, mamba_num_heads, mamba_head_dim, ssm_state_size]`` (fp32,
    HF's ``mamba_ssm_cache_dtype``). Fixed size, replicated over context-parallel ranks, kept on the device."""

    kind = "mamba2"

    @classmethod
    def planned_bytes(cls, config, layer_idx: int, tokens_on_rank: int, dtype_bytes: int = 2) -> int:
        heads, head_dim, n = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size
        conv_dim = heads * head_dim + 2 * config.n_groups * n
        return conv_dim * (config.conv_kernel - 1) * dtype_bytes + heads * head_dim * n * 4


def block_graph_bytes(config, kind: str, b: int) -> int:
    """The planner's formula: per token, what autograd keeps for one Nemotron-H block of ``kind`` (its norm's input
    and output plus its one mixer). An estimate from the tensors the mixers keep, not checked against a device peak
    (``tests/test_planner.py`` measures the Qwen and GLM families only)."""
    h = config.hidden_size
    if kind == MAMBA:  # Mamba-2: in_proj out, conv in/out, gate, gated norm; the SSD scan in fp32
        heads, p, n, g = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups
        inner, conv = heads * p, heads * p + 2 * g * n
        # per token: its row of the chunk's decay and score matrices, x dt, B and C per head
        scan = (2 * heads * config.chunk_size + inner + 2 * heads * n + 2 * inner) * 4
        return (2 * h + (inner + conv + heads) + 2 * conv + 3 * inner) * b + scan
    if kind == ATTENTION:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return (2 * h + 3 * (q + 2 * kv) + 2 * q) * b + q * 4
    if kind == MOE:
        inter = config.moe_intermediate_size * config.num_experts_per_tok
        return (2 * h + 3 * inter + 3 * config.moe_shared_expert_intermediate_size) * b
    return (2 * h + 3 * config.intermediate_size) * b  # mlp: up, act(up), down in


def mamba2_forward(module: nn.Module, hidden_states: torch.Tensor, ctx) -> torch.Tensor:
    """HF's ``NemotronHMamba2Mixer.forward`` (its torch path) continuing from (and, per ``ctx.mode``, producing) a
    :class:`Mamba2State`: same math, dtypes and submodules; only the state handling, the conv
    (:func:`causal_conv1d_with_state`) and the scan (:func:`mamba2_scan`) differ."""
    idx = module.layer_idx
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    gate, xbc, dt = module.in_proj(hidden_states).split(
        [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1
    )
    start = ctx.recurrent_start(idx, Mamba2State, batch)
    conv_out, conv_state = causal_conv1d_with_state(
        xbc.transpose(1, 2),
        module.conv1d.weight,
        module.conv1d.bias,
        conv_state=start.conv,
        activation=module.activation,
        state_grad=ctx.state_grad,
    )
    groups = module.n_groups * module.ssm_state_size
    x, b, c = torch.split(conv_out.transpose(1, 2), [module.intermediate_size, groups, groups], dim=-1)
    keep = ctx.mode.needs_final_state
    y, ssm = mamba2_scan(
        x.reshape(batch, seq_len, module.num_heads, module.head_dim),
        dt,
        -torch.exp(module.A_log.float()),
        b.reshape(batch, seq_len, module.n_groups, module.ssm_state_size),
        c.reshape(batch, seq_len, module.n_groups, module.ssm_state_size),
        module.D,
        module.dt_bias,
        chunk_size=module.chunk_size,
        dt_limit=module.time_step_limit,
        initial_state=start.recurrent,
        output_final_state=keep,
        state_grad=ctx.state_grad,
    )
    if keep:
        ctx.keep_final_state(idx, Mamba2State(conv_state, ssm))
    y = module.norm(y.reshape(batch, seq_len, -1), gate)
    return module.out_proj(y.to(dtype))


def _replay(self, hidden_states, ctx, cache_params=None, attention_mask=None):
    if cache_params is not None:
        raise LongStrawError("a LongStraw call cannot also use an HF cache (cache_params)")
    if attention_mask is not None:
        raise LongStrawError("a LongStraw call takes no attention_mask: rows are right-padded instead")
    return mamba2_forward(self, hidden_states, ctx)


try:  # fire conv1d's accelerate hooks around the replay, as HF's forward does (its weight is read directly)
    from transformers.integrations.accelerate import force_accelerate_hooks

    _replay = force_accelerate_hooks("conv1d")(_replay)
except ImportError:  # pragma: no cover - older transformers
    pass


def mixer_forward(self, hidden_states, *args, **kwargs):
    """``NemotronHMamba2Mixer.forward``, bound per instance: the stock forward (or the accelerate hook installed
    before) unless the engine's context is passed down."""
    ctx = kwargs.pop(CTX_KWARG, None)
    if ctx is None:
        stock = self._longstraw_stock_forward or type(self).forward.__get__(self)
        return stock(hidden_states, *args, **kwargs)
    if args:
        raise LongStrawError(f"{type(self).__name__}: pass cache_params / attention_mask by keyword")
    return _replay(self, hidden_states, ctx, kwargs.get("cache_params"), kwargs.get("attention_mask"))


class NemotronHPatch(FamilyPatch):
    """``nemotron_h``: ``NemotronHForCausalLM``."""

    model_types = ("nemotron_h",)

    def layer_types(self, config) -> list[str]:
        return list(config.layers_block_type)

    def layer_state_type(self, config, layer_idx: int) -> type[LayerState] | None:
        kind = self.layer_types(config)[layer_idx]
        return {MAMBA: Mamba2State, ATTENTION: KVPages}.get(kind)

    def planned_layer_graph_bytes(self, config, kind: str, tokens: int, dtype_bytes: int) -> int:
        """One mixer a block: :func:`block_graph_bytes`."""
        return tokens * block_graph_bytes(config, kind, dtype_bytes)

    def no_attention_masks(self, model: nn.Module) -> dict:
        # a prepared mapping: HF then builds no causal or recurrent masks (the Mamba-2 replay refuses masks)
        return {ATTENTION: None, MAMBA: None}

    def mixers(self, model: nn.Module) -> list[nn.Module]:
        return [layer.mixer for layer in self.decoder(model).layers if layer.block_type == MAMBA]

    def validate(self, model: nn.Module) -> None:
        config = self.text_config(model)
        other = sorted(set(self.layer_types(config)) - {MAMBA, ATTENTION, MLP, MOE})
        if other:
            raise self.unsupported(f"block types {other}")
        self.validate_common(config)
        if MAMBA in self.layer_types(config):
            act = getattr(config, "mamba_hidden_act", None)
            if act not in _CONV_ACTIVATIONS:
                raise self.unsupported(f"mamba_hidden_act={act!r} for the Mamba-2 conv (only silu is)")
            if config.mamba_num_heads % config.n_groups:
                raise self.unsupported(
                    f"mamba_num_heads={config.mamba_num_heads} not a multiple of n_groups={config.n_groups}"
                )
        for module in self.mixers(model):
            if not all(hasattr(module, a) for a in ("conv1d", "A_log", "in_proj", "time_step_limit")):
                raise self.unsupported(f"a Mamba-2 mixer of type {type(module).__name__}")

    def apply(self, model: nn.Module) -> None:
        for module in self.mixers(model):
            if not getattr(module, "_longstraw_mamba2", False):
                module._longstraw_stock_forward = module.__dict__.get("forward")  # an accelerate hook, if any
                module.forward = mixer_forward.__get__(module)
                module._longstraw_mamba2 = True
