"""What a model family tells the engine: where its decoder stack is and how its layers are laid out.

A family patch owns only what differs between families. The engine (``longstraw_trl.engine``) owns the
prompt state, capture and replay; attention layers reach it through the attention-interface dispatch,
other layer kinds (Gated DeltaNet, ...) through forwards the family installs in :meth:`apply`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longstraw_trl.errors import UnsupportedModelError
from longstraw_trl.layer_state import KVPages, LayerState, WindowKV

from .planned_bytes import attention_graph_bytes, capture_chunk_bytes, mlp_graph_bytes

FULL, SLIDING = "full_attention", "sliding_attention"
# RoPE variants whose frequencies depend on the largest position *in the call*: a chunked capture would
# not reproduce a full forward.
CALL_DEPENDENT_ROPE = ("dynamic", "longrope")


class FamilyPatch:
    """Base class of one model family's patch (one module per family, Liger-Kernel style)."""

    #: ``config.model_type`` values this patch serves.
    model_types: tuple[str, ...] = ()

    def text_config(self, model: nn.Module):
        return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def decoder(self, model: nn.Module) -> nn.Module:
        """The module holding ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``."""
        return model.model

    def validate(self, model: nn.Module) -> None:
        """Raise :class:`UnsupportedModelError` for options the engine does not reproduce exactly."""

    def validate_common(self, config) -> None:
        """What no family reproduces: attention dropout, and RoPE variants whose frequencies depend on the length of
        each call (``rope_parameters`` as one dict, or one per layer type)."""
        if getattr(config, "attention_dropout", 0.0):
            raise self.unsupported(f"attention_dropout={config.attention_dropout}")
        rope = getattr(config, "rope_parameters", None) or {}
        per_type = bool(rope) and all(isinstance(x, dict) for x in rope.values())
        for params in rope.values() if per_type else [rope]:
            if params.get("rope_type") in CALL_DEPENDENT_ROPE:
                raise self.unsupported(
                    f"rope_type={params['rope_type']!r} (its frequencies depend on the length of each call, so "
                    "a chunked capture cannot reproduce a full forward)"
                )

    def apply(self, model: nn.Module) -> None:
        """Install family-specific forwards (idempotent). Attention needs none: it is dispatched."""

    def layer_state_type(self, config, layer_idx: int) -> type[LayerState] | None:
        """The :class:`LayerState` subclass layer ``layer_idx`` keeps (K/V pages for full attention); ``None`` for a
        block that keeps none (Nemotron-H's MLP and MoE blocks).

        A family with other layer kinds returns its own state class here; the planner sizes the state
        with that class's ``planned_bytes``, and the family's layer forward creates it through
        ``ForwardContext.layer_state``. The engine itself knows no layer kind but attention.
        """
        return KVPages

    def planned_layer_graph_bytes(self, config, kind: str, tokens: int, dtype_bytes: int) -> int:
        """The planner's formula: what autograd keeps for one decoder layer of ``kind`` (a ``layer_types`` entry)
        over ``tokens`` tokens. By default a GQA attention and its MLP (:mod:`.planned_bytes`)."""
        return tokens * (attention_graph_bytes(config, dtype_bytes) + mlp_graph_bytes(config, dtype_bytes))

    def planned_capture_bytes(self, config, chunk: int, dtype_bytes: int) -> int:
        """The planner's formula: a capture chunk's transient activations at their peak, through one layer."""
        return capture_chunk_bytes(config, chunk, dtype_bytes)

    def planned_segment_layer_bytes(
        self, config, kind: str, segment: int, resident: int, dtype_bytes: int
    ) -> int:
        """The planner's formula: what one layer of ``kind`` holds at the peak of the full gradient's prompt
        backward over a ``segment`` of prompt tokens after ``resident`` ones. By default its graph over the segment
        (:meth:`planned_layer_graph_bytes`)."""
        return self.planned_layer_graph_bytes(config, kind, segment, dtype_bytes)

    def logits_transform(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the stock ``*ForCausalLM.forward`` does to the head's logits (a final soft-cap, a logit
        scale), for the engine's head request, which computes log-probs from the head directly.
        ``None``: nothing (the logits are the head's output)."""
        return None

    def no_attention_masks(self, model: nn.Module) -> dict | None:
        """The ``attention_mask`` a LongStraw call passes to the root forward. The engine's attention is
        causal by construction and ignores masks; ``None`` lets HF build whatever it builds (for SDPA with no
        padding: nothing). Families whose forward takes a prepared mapping return one of no masks."""
        return None

    def position_ids(self, start, length: int, batch: int, device: torch.device) -> torch.Tensor:
        """``[batch, length]`` positions from ``start`` (an int or a 0-dim device tensor)."""
        pos = torch.arange(length, device=device) + start
        return pos.unsqueeze(0).expand(batch, length)

    def max_positions(self, model: nn.Module) -> int | None:
        return getattr(self.text_config(model), "max_position_embeddings", None)

    def unsupported(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{type(self).__name__}: {what} is not supported by LongStraw-TRL")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft / accelerate / DDP wrapper."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner


class SlidingWindowPatch(FamilyPatch):
    """Families whose attention modules pass their ``sliding_window`` (``None`` on full layers) to the
    attention interface: sliding layers keep a :class:`WindowKV` (the last ``sliding_window - 1`` prompt
    tokens), full layers :class:`KVPages`. The layout is ``config.layer_types`` (``sliding_attention`` /
    ``full_attention``), or, for configs without it (Mistral, Qwen3-MoE), ``config.sliding_window`` on
    every layer or none. A subclass adds what its family does differently (logit post-processing, ...)."""

    def layer_types(self, config) -> list[str]:
        types = getattr(config, "layer_types", None)
        if types:
            return list(types)[: config.num_hidden_layers]
        window = getattr(config, "sliding_window", None)
        return [SLIDING if window is not None else FULL] * config.num_hidden_layers

    def layer_state_type(self, config, layer_idx: int) -> type[LayerState]:
        return WindowKV if self.layer_types(config)[layer_idx] == SLIDING else KVPages

    def no_attention_masks(self, model: nn.Module) -> dict | None:
        # With per-layer types the forward takes a prepared mapping: HF then builds no masks (the engine
        # masks by position itself). Without, it builds one mask per call, which the engine ignores.
        if getattr(self.text_config(model), "layer_types", None):
            return {FULL: None, SLIDING: None}
        return None

    def validate(self, model: nn.Module) -> None:
        config = self.text_config(model)
        other = sorted(set(self.layer_types(config)) - {FULL, SLIDING})
        if other:
            raise self.unsupported(f"layer types {other} (only {FULL!r} and {SLIDING!r} are)")
        if SLIDING in self.layer_types(config) and not getattr(config, "sliding_window", None):
            raise self.unsupported(
                f"sliding_window={getattr(config, 'sliding_window', None)!r} on sliding layers"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise self.unsupported("use_bidirectional_attention=True (the engine's attention is causal)")
        self.validate_common(config)
