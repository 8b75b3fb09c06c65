"""Per-token log-probabilities (and entropies) from hidden states, a chunk of logits at a time (``chunked``), and the
plain full-logits reference (``naive``)."""

from .chunked import softcap_logits, token_logprobs
from .naive import naive_token_logprobs

__all__ = ["naive_token_logprobs", "softcap_logits", "token_logprobs"]
