"""Per-token log-probs from hidden states without materialising ``[N, vocab]`` fp32 logits at once.

Rows are processed in chunks; under autograd each chunk is checkpointed, so backward recomputes its
logits instead of keeping them. ``token_logprobs_reference`` is the plain full-logits version.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Rows per chunk are chosen so that one chunk's fp32 logits stay under this many elements (256 MiB).
LOGITS_CHUNK_ELEMENTS = 1 << 26


def _chunk_logprobs(h: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module, temperature: float):
    logits = lm_head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def token_logprobs(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log_softmax(lm_head(hidden) / temperature)[targets]`` for ``hidden [..., H]``, ``targets [...]``."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    rows = max(1, LOGITS_CHUNK_ELEMENTS // lm_head.weight.shape[0])
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    parts = []
    for s in range(0, h.shape[0], rows):
        args = (h[s : s + rows], t[s : s + rows], lm_head, temperature)
        parts.append(
            checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)
        )
    return torch.cat(parts).view(shape)


def token_logprobs_reference(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    logits = lm_head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
