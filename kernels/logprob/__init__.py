"""Per-token log-probabilities (and entropies) from hidden states, a chunk of logits at a time."""

from .chunked import softcap_logits, token_logprobs

__all__ = ["softcap_logits", "token_logprobs"]
