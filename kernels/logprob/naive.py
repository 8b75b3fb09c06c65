"""The plain full-logits reference of the chunked per-token log-probabilities."""

from __future__ import annotations

import torch
from torch import nn


def naive_token_logprobs(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    logits = lm_head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
