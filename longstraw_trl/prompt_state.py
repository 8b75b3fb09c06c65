"""The resident prompt state: what later tokens read of a captured prompt, and nothing else.

A :class:`PromptState` holds one layer state per decoder layer (:mod:`longstraw_trl.layer_state`), the model-native
state of the prompt's first ``P - 1`` tokens:
- full-attention layers: K/V (``KVPages``, grows with P, sharded over context-parallel ranks);
- sliding-window attention layers: the last ``window - 1`` tokens' K/V (``WindowKV``, fixed size);
- other layer kinds (Gated DeltaNet's conv + recurrent state, an MLA latent, ...): the state class their
  family patch supplies (``FamilyPatch.layer_state_type``).
The last prompt token is kept as an id, not as a hidden state: every replay and every generation runs it
through the model together with the response (see docs/design.md, "Objective"), so the log-prob of
completion token 0 depends on every layer.

:class:`~longstraw_trl.layer_state.LayerState` is the protocol the engine, the planner, context parallelism and
offload use; a family adds a layer kind by subclassing it, without touching the engine. Replays only read the state;
extending (:func:`longstraw_trl.engine.extend_state`) appends to a fork that shares what the original holds.
"""

from __future__ import annotations

import torch

from .errors import LongStrawError
from .host_memory import DeviceShare, pinned_empty, storage_device
from .layer_state import LayerState


def _kept_on(kept: LayerState | None, device: torch.device) -> LayerState | None:
    """A kept boundary state (a ``"leaf"`` kind's snapshot) with its tensors on ``device`` (pinned when copied to
    the host from a GPU); itself when they are there already."""
    if kept is None or all(t is None or t.device == device for t in kept.grad_tensors()):
        return kept
    moved = []
    for t in kept.grad_tensors():
        if t is not None and device.type == "cpu" and t.device.type == "cuda":
            t = pinned_empty(tuple(t.shape), t.dtype).copy_(t)
        elif t is not None:
            t = t.to(device, non_blocking=True)
        moved.append(t)
    return kept.with_tensors(moved)


class PromptState:
    """The captured, read-only state of one prompt (see :func:`longstraw_trl.capture_prompt`).

    Attributes:
        num_tokens: prompt length P.
        resident_tokens: tokens held in the layer states, ``P - 1``: the last prompt token is replayed.
        last_token: id of the last prompt token (0-dim LongTensor on ``device``); every replay and
            generation runs it first, so completion token 0 is scored through the whole network.
        layers: per decoder-layer state (:class:`LayerState`), indexed by layer number.
        device: where replays compute. K/V live there too unless ``offload="cpu"``.
        offload: ``None`` (resident on ``device``) or ``"cpu"`` (pinned host memory, streamed per page).
        cp_group: the context-parallel process group the K/V pages are spread over (``None``: one rank).
        page_size: tokens per page (the unit of CP ownership and of offload streaming);
        chunk_size: prompt tokens per prefill step (:func:`~longstraw_trl.engine.extend_state` reuses it).
        chunk_seconds: seconds of each prefill chunk of the call that built this state (capture or extend).
        device_share: with ``offload="cpu"``, while a capture creates the layer states: the device budget whole
            layers stay on ``device`` within (:class:`~longstraw_trl.host_memory.DeviceShare`); ``None``: every
            offloadable layer goes to host memory.
    """

    def __init__(
        self,
        layers: dict[int, LayerState],
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
        self.last_token: torch.Tensor | None = None
        self.chunk_seconds: list[float] = []
        # the full gradient (``capture_prompt(keep_boundaries=True)``): the resident tokens' ids, and at
        # every capture-chunk boundary (resident tokens before it) the fixed-size layers' states there
        self.token_ids: torch.Tensor | None = None
        self.boundaries: dict[int, dict[int, LayerState]] | None = None
        # offload="cpu": the layers created while this is set stay on the device while they fit its budget (capture)
        self.device_share: DeviceShare | None = None

    @property
    def resident_tokens(self) -> int:
        return max(self.num_tokens - 1, 0)

    def at(self, tokens: int) -> PromptState:
        """A read-only view of this state after its first ``tokens`` resident tokens (a segment boundary:
        growing layers give a prefix view, fixed-size ones the state kept there)."""
        if tokens == self.resident_tokens:
            return self
        if tokens == 0:  # the start of the sequence: every layer from its initial state
            view = PromptState({}, self.device, self.offload, self.cp_group, self.page_size, self.chunk_size)
            view.num_tokens = 1
            return view
        kept = (self.boundaries or {}).get(tokens)
        if kept is None:
            raise LongStrawError(
                f"the prompt state kept no layer states at token {tokens} (boundaries: "
                f"{sorted(self.boundaries or {})}): capture with keep_boundaries=True"
            )
        layers = {
            i: layer.prefix(tokens, _kept_on(kept.get(i), self.device)) for i, layer in self.layers.items()
        }
        view = PromptState(layers, self.device, self.offload, self.cp_group, self.page_size, self.chunk_size)
        view.num_tokens = tokens + 1
        return view

    def branch_point(self, tokens: int) -> int:
        """The most resident tokens, at most ``tokens``, after which :meth:`prefix_state` can give this state back:
        ``tokens`` itself when every layer's prefix is a view of what it holds (K/V pages, MLA latent pages);
        otherwise the last boundary kept at or before it (fixed-size layers, GDN or a sliding window, cannot be
        rewound: only their states kept at capture-chunk boundaries can), 0 when none is."""
        tokens = max(0, min(tokens, self.resident_tokens))
        if tokens == self.resident_tokens or all(layer.boundary() is None for layer in self.layers.values()):
            return tokens
        return max((t for t in self.boundaries or {} if t <= tokens), default=0)

    def prefix_state(self, tokens: int, last_token: torch.Tensor) -> PromptState:
        """The state of this prompt's first ``tokens + 1`` tokens, ``last_token`` (the id at position ``tokens``)
        being the last: a branch point that :func:`~longstraw_trl.engine.extend_state` continues from. Growing layers give a view of their
        first ``tokens`` tokens (no copy), fixed-size ones the state kept there (``tokens`` must be a
        :meth:`branch_point`). What the full gradient keeps (token ids, boundaries) is cut there too."""
        if not 0 <= tokens <= self.resident_tokens:
            raise LongStrawError(
                f"prefix of {tokens} resident tokens asked of a state of {self.resident_tokens}"
            )
        kept = (self.boundaries or {}).get(tokens, {})
        if tokens == self.resident_tokens:
            layers = {i: layer.fork() for i, layer in self.layers.items()}
        else:
            layers = {i: layer.prefix(tokens, kept.get(i)) for i, layer in self.layers.items() if tokens}
        view = PromptState(layers, self.device, self.offload, self.cp_group, self.page_size, self.chunk_size)
        view.num_tokens, view.last_token = tokens + 1, last_token.view(()).to(self.device)
        if self.token_ids is not None:
            view.token_ids = self.token_ids[:tokens]
            view.boundaries = {t: k for t, k in (self.boundaries or {}).items() if t <= tokens}
        return view

    def keep_boundary(self, tokens: int) -> None:
        """Keep the fixed-size layers' states after ``tokens`` resident tokens (a segment boundary); with
        ``offload="cpu"`` they wait in host memory (one per capture chunk: 144 MiB each for Qwen3.6-27B) and
        :meth:`at` brings a boundary's back when its segment is recomputed."""
        if self.boundaries is None:
            self.boundaries = {}
        host = storage_device(self.device, self.offload)
        self.boundaries[tokens] = {
            i: _kept_on(kept, host)
            for i, layer in self.layers.items()
            if (kept := layer.boundary()) is not None
        }

    # --- bookkeeping ------------------------------------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held on this rank by kind of state (``kv``, ``gdn``, ...), allocation slack excluded."""
        out: dict[str, int] = {}
        for layer in self.layers.values():
            for kind, n in layer.nbytes_by_kind().items():
                out[kind] = out.get(kind, 0) + n
        return out

    def nbytes(self) -> int:
        """Total bytes of state held on this rank, allocation slack excluded."""
        return sum(self.nbytes_by_kind().values())

    def slack_bytes(self) -> int:
        """Allocated but unfilled bytes on this rank (reported apart from :meth:`nbytes`)."""
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
        new.num_tokens, new.last_token = self.num_tokens, self.last_token
        new.token_ids = self.token_ids
        new.boundaries = None if self.boundaries is None else dict(self.boundaries)
        return new

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in self.nbytes_by_kind().items())
        return f"PromptState(num_tokens={self.num_tokens}, {kinds}, offload={self.offload})"

    def check_not_empty(self) -> None:
        if self.num_tokens == 0 or self.last_token is None:
            raise LongStrawError("PromptState is empty: capture a prompt first")
