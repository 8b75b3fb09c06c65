"""Per-token log-probs (and entropies) from hidden states without materialising ``[N, vocab]`` fp32 logits at once.

Rows are processed in chunks; under autograd each chunk is checkpointed, so backward recomputes its
logits instead of keeping them. ``naive_token_logprobs`` is the plain full-logits version.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Rows per chunk are chosen so that one chunk's fp32 logits stay under this many elements (256 MiB).
LOGITS_CHUNK_ELEMENTS = 1 << 26


class _LogprobAndEntropy(torch.autograd.Function):
    """``(log p[target], H)`` of ``softmax(z)`` per row, with a hand-written backward that keeps only ``log p``.

    ``d log p_t / dz = onehot_t - p`` and ``dH / dz = -p * (log p + H)``, so ``dz = g1 * onehot - p * (g1 + g2 *
    (log p + H))``: backward holds three ``[rows, vocab]`` fp32 tensors (``log p``, ``p``, the gradient), as the
    log-prob-only path does, where autograd through ``-(p * log p).sum()`` would keep and build several more."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, targets: torch.Tensor):
        logp = torch.log_softmax(z, dim=-1)
        picked = logp.gather(-1, targets[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logp, entropy, targets)
        return picked, entropy

    @staticmethod
    def backward(ctx, g_picked: torch.Tensor, g_entropy: torch.Tensor):
        logp, entropy, targets = ctx.saved_tensors
        grad = logp + entropy[:, None]
        grad.mul_(g_entropy[:, None]).add_(g_picked[:, None]).mul_(logp.exp()).neg_()
        grad.scatter_add_(-1, targets[:, None], g_picked[:, None])
        return grad, None


def _chunk_logprobs(
    h: torch.Tensor,
    targets: torch.Tensor,
    lm_head: nn.Module,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    logits_transform: Callable | None = None,
):
    logits = lm_head(h)
    if logits_transform is not None:  # in the head's dtype, as the stock model applies it
        logits = logits_transform(logits)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if with_entropy and entropy_grad and torch.is_grad_enabled():
        return _LogprobAndEntropy.apply(logits, targets)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    if not with_entropy:
        return picked
    with torch.no_grad():  # logged (or compared with a quantile), never differentiated
        entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def token_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    logits_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(f(lm_head(hidden)) / temperature)[targets]`` for ``hidden [..., H]``, ``targets [...]``,
    with ``f = logits_transform`` (identity when ``None``; e.g. a final logit soft-cap).

    With ``with_entropy`` also the per-token entropy ``-sum_v p_v log p_v`` of the same distribution, computed
    from the same chunk of logits: without gradient, unless ``entropy_grad`` (under autograd, the entropies are
    then differentiable in ``hidden`` and the head's parameters, through the same checkpointed chunks: backward
    recomputes one chunk's logits at a time for both outputs).

    ``lm_head`` is the output projection (a module, or a module's bound forward); rows are chunked so that
    one chunk's logits stay under ``LOGITS_CHUNK_ELEMENTS`` (1,024 rows when the vocabulary is unknown).
    """
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(h.device)
    grad = torch.is_grad_enabled()
    parts: list = []

    def run(s: int, e: int):
        args = (h[s:e], t[s:e], lm_head, temperature, with_entropy, entropy_grad, logits_transform)
        return checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)

    vocab = getattr(getattr(lm_head, "weight", None), "shape", (None,))[0]
    if vocab is None:
        owner = getattr(lm_head, "__self__", None)
        vocab = getattr(getattr(owner, "weight", None), "shape", (None,))[0]
    rows = max(1, LOGITS_CHUNK_ELEMENTS // vocab) if vocab else 1024
    for s in range(0, h.shape[0], rows):
        parts.append(run(s, s + rows))
    if not with_entropy:
        return torch.cat(parts).view(shape)
    return torch.cat([p[0] for p in parts]).view(shape), torch.cat([p[1] for p in parts]).view(shape)


def softcap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``: the final logit soft-cap of Gemma 2 / 3, as HF computes it."""
    return torch.tanh(logits / cap) * cap
