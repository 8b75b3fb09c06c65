"""Gated DeltaNet's gated delta rule: the chunked forward and backward (``chunk``, ``chunk_backward``), the fused
decode step (``decode``) and the token-by-token recurrence as the reference (``naive``)."""

from .chunk import fla_available, gated_delta_rule, gated_delta_step
from .decode import gdn_decode_available, gdn_decode_step

__all__ = ["fla_available", "gated_delta_rule", "gated_delta_step", "gdn_decode_available", "gdn_decode_step"]
