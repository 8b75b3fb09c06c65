"""The resident prompt state: what later tokens read of a captured prompt, and nothing else.

A :class:`PromptState` holds, per decoder layer, the model-native state of the prompt:
- full-attention layers: K/V in fixed-size pages (:class:`KVPages`);
- Gated DeltaNet layers: conv and recurrent state (:class:`GDNState`, fixed size, independent of P);
and the final-norm hidden state of the last prompt token (the log-prob of completion token 0 comes from
it). Replays only read the state; ``extend`` appends to a fork that shares every full page.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import LongStrawError


def _storage_device(device: torch.device, offload: str | None) -> torch.device:
    if offload is None:
        return device
    if offload == "cpu":
        return torch.device("cpu")
    raise ValueError(f"offload must be None or 'cpu', got {offload!r}")


@dataclass
class KVPages:
    """Paged K/V of one full-attention layer.

    Pages are ``[num_kv_heads, page_size, head_dim]`` tensors allocated one at a time as tokens arrive;
    earlier pages are never copied. With context parallelism, global page ``j`` belongs to rank
    ``j % cp_size`` and only owned pages are stored here; ``num_tokens`` counts the whole prompt.
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype: torch.dtype
    storage: torch.device
    cp_rank: int = 0
    cp_size: int = 1
    num_tokens: int = 0
    # global page index -> (k, v); a dict so ranks hold disjoint subsets
    pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    kind = "kv"

    def owns(self, page_index: int) -> bool:
        return page_index % self.cp_size == self.cp_rank

    def _new_page(self) -> tuple[torch.Tensor, torch.Tensor]:
        pin = self.storage.type == "cpu" and torch.cuda.is_available()
        k = torch.empty(
            self.num_kv_heads, self.page_size, self.head_dim, dtype=self.dtype, device=self.storage
        )
        v = torch.empty(
            self.num_kv_heads, self.page_size, self.v_head_dim, dtype=self.dtype, device=self.storage
        )
        return (k.pin_memory(), v.pin_memory()) if pin else (k, v)

    @torch.no_grad()
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k [Hkv, T, D]``, ``v [Hkv, T, Dv]`` after the last token (only owned pages are kept)."""
        t, pos = k.shape[1], 0
        while pos < t:
            page, offset = divmod(self.num_tokens, self.page_size)
            n = min(self.page_size - offset, t - pos)
            if self.owns(page):
                if page not in self.pages:
                    self.pages[page] = self._new_page()
                kp, vp = self.pages[page]
                kp[:, offset : offset + n].copy_(k[:, pos : pos + n], non_blocking=True)
                vp[:, offset : offset + n].copy_(v[:, pos : pos + n], non_blocking=True)
            self.num_tokens += n
            pos += n

    def iter_pages(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the filled part of every owned page as ``(k, v)`` on ``device`` (streamed if offloaded)."""
        for page in sorted(self.pages):
            fill = min(self.page_size, self.num_tokens - page * self.page_size)
            kp, vp = self.pages[page]
            yield (
                kp[:, :fill].to(device, non_blocking=True),
                vp[:, :fill].to(device, non_blocking=True),
            )

    def token_bytes(self) -> int:
        """Bytes of one token's K and V in this layer."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.dtype.itemsize

    def stored_tokens(self) -> int:
        return sum(min(self.page_size, self.num_tokens - p * self.page_size) for p in self.pages)

    def nbytes(self) -> int:
        """Bytes of the stored tokens (the formula), excluding unfilled page slack."""
        return self.stored_tokens() * self.token_bytes()

    def slack_bytes(self) -> int:
        """Allocated but unfilled bytes at the end of the last page."""
        return len(self.pages) * self.page_size * self.token_bytes() - self.nbytes()

    def fork(self) -> KVPages:
        """A copy that shares every full page; a partially filled last page is copied (copy-on-write)."""
        pages = dict(self.pages)
        last, fill = divmod(self.num_tokens, self.page_size)
        if fill and last in pages:
            pages[last] = tuple(t.clone() for t in pages[last])
        return KVPages(
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
            self.page_size,
            self.dtype,
            self.storage,
            self.cp_rank,
            self.cp_size,
            self.num_tokens,
            pages,
        )


@dataclass
class GDNState:
    """Gated DeltaNet state of one linear-attention layer at the prompt boundary.

    ``conv`` holds the last ``kernel_size - 1`` pre-convolution inputs ``[1, C, kernel_size - 1]`` and
    ``recurrent`` the delta-rule state ``[1, H, K, V]``. Its size does not depend on the prompt length.
    Replicated on every context-parallel rank.
    """

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None

    kind = "gdn"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)

    def slack_bytes(self) -> int:
        return 0

    def fork(self) -> GDNState:
        # Captures replace these tensors rather than writing into them, so sharing is safe.
        return GDNState(self.conv, self.recurrent)


class PromptState:
    """The captured, read-only state of one prompt (see :func:`longstraw_trl.capture_prompt`).

    Attributes:
        num_tokens: prompt length P.
        layers: per decoder-layer state (``KVPages`` or ``GDNState``), indexed by layer number.
        last_hidden: final-norm hidden state of the last prompt token ``[hidden]``; completion token 0 is
            scored from it.
        device: where replays compute. Pages live there too unless ``offload="cpu"``.
        offload: ``None`` (resident on ``device``) or ``"cpu"`` (pinned host memory, streamed per page).
        cp_group: the context-parallel process group the pages are spread over (``None``: one rank).
        page_size: tokens per K/V page; chunk_size: prompt tokens per prefill step (``extend`` reuses it).
    """

    def __init__(
        self,
        layers: dict[int, KVPages | GDNState],
        device: torch.device,
        offload: str | None = None,
        cp_group=None,
        page_size: int = 0,
        chunk_size: int = 0,
    ):
        self.layers = layers
        self.chunk_size = chunk_size
        self.device = device
        self.offload = offload
        self.cp_group = cp_group
        self.page_size = page_size
        self.num_tokens = 0
        self.last_hidden: torch.Tensor | None = None

    # --- bookkeeping ------------------------------------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held on this rank by kind of state (``kv``, ``gdn``, ...), page slack excluded."""
        out: dict[str, int] = {}
        for layer in self.layers.values():
            out[layer.kind] = out.get(layer.kind, 0) + layer.nbytes()
        return out

    def nbytes(self) -> int:
        """Total bytes of state held on this rank, page slack excluded."""
        return sum(self.nbytes_by_kind().values())

    def slack_bytes(self) -> int:
        """Allocated but unfilled page bytes on this rank (reported apart from :meth:`nbytes`)."""
        return sum(layer.slack_bytes() for layer in self.layers.values())

    def fork(self) -> PromptState:
        new = PromptState(
            {i: s.fork() for i, s in self.layers.items()},
            self.device,
            self.offload,
            self.cp_group,
            self.page_size,
            self.chunk_size,
        )
        new.num_tokens, new.last_hidden = self.num_tokens, self.last_hidden
        return new

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in self.nbytes_by_kind().items())
        return f"PromptState(num_tokens={self.num_tokens}, {kinds}, offload={self.offload})"

    # --- operations (implemented by the engine) ---------------------------------------------------
    def extend(self, model, more_ids: torch.Tensor, **kwargs) -> PromptState:
        """Append prompt tokens (e.g. a new turn); returns a new state sharing this one's full pages."""
        from .engine import extend_state

        return extend_state(self, model, more_ids, **kwargs)

    def logprobs(
        self,
        model,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        grad: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """``[G, R]`` log-prob of each completion token given prompt + completion prefix.

        ``grad=True`` builds the autograd graph for exactly these rows (gradients reach the model's
        parameters through the response tokens only; the prompt state is a constant).
        """
        from .engine import replay_logprobs

        return replay_logprobs(self, model, completion_ids, completion_mask, temperature, grad, **kwargs)

    def generate(self, model, num_generations: int, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Sample ``num_generations`` continuations sharing this prompt state (``[G, R]``, padded)."""
        from .generation import generate_from_state

        return generate_from_state(self, model, num_generations, max_new_tokens, **kwargs)

    def check_not_empty(self) -> None:
        if self.num_tokens == 0 or self.last_hidden is None:
            raise LongStrawError("PromptState is empty: capture a prompt first")
