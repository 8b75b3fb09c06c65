"""Qwen3-Next (``qwen3_next``): the Gated DeltaNet + gated full-attention hybrid before Qwen3.5.

Its GDN layer is Qwen3.5's except for the input projections: one fused ``in_proj_qkvz`` and one
``in_proj_ba``, grouped per key head, which HF reorders with the module's own
``fix_query_key_value_ordering``. Everything after the projections (conv, gating, delta rule, gated norm,
``out_proj``) and all the state handling is the shared replay in :mod:`.qwen3_5`. Positions are plain
1-D RoPE positions (no mrope).
"""

from __future__ import annotations

import torch
from torch import nn

from .qwen3_5 import GatedDeltaNetHybridPatch


class Qwen3NextPatch(GatedDeltaNetHybridPatch):
    model_types = ("qwen3_next",)

    def project(self, module: nn.Module, hidden_states: torch.Tensor):
        batch, seq_len, _ = hidden_states.shape
        query, key, value, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
        )
        mixed_qkv = torch.cat([x.reshape(batch, seq_len, -1) for x in (query, key, value)], dim=-1)
        return mixed_qkv, z, b, a
