"""Shared-prefix sampling: G continuations decoded together on one read-only prompt state.

Every decode step feeds the G newest tokens through the model at once; each attention layer reads the
prompt pages once for all G rows (their queries are folded into one batch of rows) and its own
response K/V from a per-call buffer. Logits processing uses transformers' own warpers in
``generate``'s order (temperature, top-k, top-p, min-p), and draws with ``torch.multinomial``, so with
the same seed the draws equal ``model.generate``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .engine import ReplayContext, check_positions, forward_model
from .errors import LongStrawError
from .state import PromptState

# Decoding checks whether every row has finished (a host synchronisation) once per this many steps; the
# output is trimmed to what stopping at once would have given.
DONE_CHECK_INTERVAL = 16
# LONGSTRAW_CUDA_GRAPHS=0 turns the decode step's CUDA graph off (the default is on, on CUDA).
CUDA_GRAPHS_ENV = "LONGSTRAW_CUDA_GRAPHS"

logger = logging.getLogger(__name__)


def _warpers(temperature: float, top_k: int | None, top_p: float, min_p: float | None) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None and min_p > 0.0:
        procs.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    return procs


@torch.no_grad()
def generate_from_state(
    state: PromptState,
    model,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    min_p: float | None = None,
    do_sample: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    cuda_graphs: bool | None = None,
) -> torch.Tensor:
    """Sample ``[G, <= max_new_tokens]`` completion ids continuing ``state``'s prompt.

    Rows that emit an EOS token are padded with ``pad_token_id`` afterwards (default: the first EOS id);
    decoding stops once every row has finished (checked every ``DONE_CHECK_INTERVAL`` steps, so the
    generator may have drawn a few more tokens than ``model.generate`` would; the output is the same).
    ``do_sample=False`` is greedy. ``cuda_graphs``: replay each decode step as one CUDA graph (default:
    on CUDA, unless the state is offloaded or spread over context-parallel ranks; see :class:`DecodeStep`).
    """
    state.check_not_empty()
    if num_generations < 1 or max_new_tokens < 1:
        raise LongStrawError("num_generations and max_new_tokens must be >= 1")
    if do_sample and (temperature is None or temperature <= 0):
        raise LongStrawError(f"temperature must be > 0 when sampling, got {temperature}")
    check_positions(model, state.num_tokens + max_new_tokens, "prompt + max_new_tokens")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    warp = _warpers(temperature, top_k, top_p, min_p) if do_sample else LogitsProcessorList()
    g, device = num_generations, state.device
    eos_t = torch.tensor(eos, device=device, dtype=torch.long)

    out = torch.full((g, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    done = torch.zeros(g, dtype=torch.bool, device=device)
    decode = DecodeStep(model, state, g, max_new_tokens, cuda_graphs)
    # The first step runs the last prompt token (the state holds the first P - 1), then each new token.
    tokens = state.last_token.view(1, 1).expand(g, 1)
    for step in range(max_new_tokens):
        scores = warp(out[:, :step], decode(tokens).float())
        if do_sample:
            probs = torch.softmax(scores, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = scores.argmax(-1)
        if state.cp_group is not None:
            # every CP rank must decode the same tokens (their logits can differ in the last bits)
            torch.distributed.broadcast(
                nxt, src=torch.distributed.get_global_rank(state.cp_group, 0), group=state.cp_group
            )
        nxt = torch.where(done, pad_token_id, nxt)
        out[:, step] = nxt
        if eos:
            done |= torch.isin(nxt, eos_t)
            if (step + 1) % DONE_CHECK_INTERVAL == 0 and bool(done.all()):
                return out[:, : _width(out, step, eos_t)]
        tokens = nxt[:, None]
    if eos and bool(done.all()):
        return out[:, : _width(out, max_new_tokens - 1, eos_t)]
    return out


def _width(out: torch.Tensor, step: int, eos_t: torch.Tensor) -> int:
    """Columns up to the step on which the last row finished (what stopping at once would have kept)."""
    is_eos = torch.isin(out[:, : step + 1], eos_t)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), step)
    return int(first.max()) + 1


class DecodeStep:
    """One decode step of G sequences on a read-only prompt state: ``step(tokens [G, 1]) -> logits [G, V]``.

    Every step has the same shapes: the sequences' own K/V sit in buffers of ``capacity`` slots (attention
    masks the unfilled ones), GDN states are updated in place, and the position is a device counter. So
    after a first eager step, the step is captured once as a CUDA graph and replayed: one launch per token
    instead of thousands of kernel launches and the Python that issues them, and no host synchronisation.
    Sampling stays outside the graph (it draws from the caller's generator). If capture fails, the steps
    run eagerly (same results), with a warning.
    """

    def __init__(
        self, model, state: PromptState, num_sequences: int, capacity: int, cuda_graphs: bool | None
    ):
        device = state.device
        if cuda_graphs is None:
            cuda_graphs = (
                device.type == "cuda"
                and state.cp_group is None  # collectives inside: keep them eager
                and state.offload is None  # host-to-device page copies inside
                and os.environ.get(CUDA_GRAPHS_ENV, "1") != "0"
            )
        if cuda_graphs and device.type != "cuda":
            raise LongStrawError("cuda_graphs=True needs the state on a CUDA device")
        self.model, self.state, self.use_graphs = model, state, cuda_graphs
        self.step = torch.zeros((), dtype=torch.long, device=device)  # tokens decoded so far
        self.ctx = ReplayContext("decode", state, capacity=capacity, step=self.step)
        self.tokens = torch.zeros(num_sequences, 1, dtype=torch.long, device=device)
        self.graph = None
        self.logits: torch.Tensor | None = None

    def _run(self) -> torch.Tensor:
        position = self.step + self.state.resident_tokens
        logits = forward_model(self.model, self.tokens, position, self.ctx, logits_to_keep=1)[:, -1]
        self.step.add_(1)
        return logits

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        autocast = dict(
            device_type="cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,  # cached casts would not outlive the capture
        )
        try:
            with torch.cuda.graph(graph), torch.autocast(**autocast):
                logits = self._run()  # recorded, not run: nothing changes until a replay
        except Exception as err:  # noqa: BLE001 - any capture failure: decode eagerly
            logger.warning("decode steps run eagerly: CUDA graph capture failed (%s)", err)
            self.use_graphs = False
            return
        self.graph, self.logits = graph, logits

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        logits = self._run()
        if self.use_graphs:  # the first eager step allocated every buffer the graph reuses
            self._capture()
        return logits
