"""What a model family tells the engine: where its decoder stack is and how its layers are laid out.

A family patch owns only what differs between families. The engine (``longstraw_trl.engine``) owns the
prompt state, capture and replay; attention layers reach it through the attention-interface dispatch,
other layer kinds (Gated DeltaNet, ...) through forwards the family installs in :meth:`apply`.
"""

from __future__ import annotations

import torch
from torch import nn

from longstraw_trl.errors import UnsupportedModelError
from longstraw_trl.state import KVPages, LayerState


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

    def apply(self, model: nn.Module) -> None:
        """Install family-specific forwards (idempotent). Attention needs none: it is dispatched."""

    def layer_state_type(self, config, layer_idx: int) -> type[LayerState]:
        """The :class:`LayerState` subclass layer ``layer_idx`` keeps (K/V pages for full attention).

        A family with other layer kinds returns its own state class here; the planner sizes the state
        with that class's ``planned_bytes``, and the family's layer forward creates it through
        ``ReplayContext.layer_state``. The engine itself knows no layer kind but attention.
        """
        return KVPages

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
