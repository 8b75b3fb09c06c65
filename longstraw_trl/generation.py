"""Shared-prefix sampling: G continuations decoded together on one read-only prompt state.

Every decode step feeds the G newest tokens through the model at once; each attention layer reads the
prompt pages once for all G rows (their queries are folded into one batch of rows) and its own
response K/V from a per-call buffer. Logits processing follows ``generate``'s order: the processors
(:class:`LogitsProcessing`: sequence bias, repetition penalty, bad words, minimum lengths, suppressed
tokens), then, when sampling, transformers' own warpers (temperature, top-k, top-p, min-p); draws use
``torch.multinomial``, so with the same seed the tokens equal ``model.generate``'s.

What ``generate`` computes from the whole input (prompt included) is kept in a form that costs nothing
per step: the repetition penalty reads a ``[V]`` presence mask of the prompt, computed once per call,
and a ``[G, V]`` mask of each sequence's generated tokens updated in place; bad-word sequences see the
prompt's last few tokens and the generated ones. ``no_repeat_ngram_size`` is the exception: it matches
each sequence's last ``n - 1`` tokens against every window of the prompt, ``O(G * P * n)`` comparisons
per step on the device (the decode step already reads ``O(P)`` of K/V per layer). Nothing in the
processing synchronises with the host.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from longstraw_trl.kernels.runtime.switches import enabled

from .context import ForwardContext, Mode
from .engine import check_max_position_embeddings, forward_model, vocab_size
from .errors import LongStrawError
from .host_memory import count_streamed_bytes, streamed_bytes
from .prompt_state import PromptState

# Decoding checks whether every row has finished (a host synchronisation) once per this many steps; the
# output is trimmed to what stopping at once would have given.
DONE_CHECK_INTERVAL = 16
# LONGSTRAW_DISABLE=cuda_graphs turns the decode step's CUDA graph off (the default is on, on CUDA).
CUDA_GRAPHS_SWITCH = "cuda_graphs"

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


class LogitsProcessing:
    """``generate``'s logits processors (before the warpers) for G sequences continuing one prompt, exactly.

    ``scores = processing(step, generated, scores)`` with ``generated [G, >= step]`` the tokens sampled so far
    (rows padded after their EOS, as ``generate`` pads them) and ``scores [G, V]``; call :meth:`append` with
    each step's tokens. In ``generate``'s order: ``sequence_bias``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``bad_words_ids``,
    ``min_length``, ``min_new_tokens``, ``suppress_tokens``, ``begin_suppress_tokens``. As in ``generate``, a
    ``min_new_tokens`` that is not ``None`` replaces ``min_length`` by ``input_length + min_new_tokens``.

    Args:
        prompt_ids: the prompt's token ids (1-D); needed for ``repetition_penalty`` (its tokens are penalised
            too), ``no_repeat_ngram_size`` (its n-grams are banned too) and multi-token ``sequence_bias`` /
            ``bad_words_ids`` (which may start in the prompt).
        input_length: the length of the input row ``generate`` would see (default: the prompt's). TRL
            left-pads the prompts of a batch to the longest (times ``pad_to_multiple_of``) with
            ``pad_token_id``: ``min_length`` counts that padding, and a bad-word prefix can match it.
            (The repetition penalty ignores it: ``generate`` masks left padding out of it.)
    """

    def __init__(
        self,
        vocab_size: int,
        num_sequences: int,
        device: torch.device,
        eos_token_id: Sequence[int] = (),
        pad_token_id: int = 0,
        prompt_ids: torch.Tensor | None = None,
        input_length: int | None = None,
        repetition_penalty: float = 1.0,
        sequence_bias=None,
        bad_words_ids: Sequence[Sequence[int]] | None = None,
        no_repeat_ngram_size: int | None = None,
        min_length: int | None = None,
        min_new_tokens: int | None = None,
        suppress_tokens: Sequence[int] | None = None,
        begin_suppress_tokens: Sequence[int] | None = None,
    ):
        self.active = bool(
            repetition_penalty != 1.0
            or no_repeat_ngram_size
            or sequence_bias
            or bad_words_ids
            or min_length
            or min_new_tokens
            or suppress_tokens
            or begin_suppress_tokens
        )
        if repetition_penalty is None or not repetition_penalty > 0:
            raise LongStrawError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        self.penalty = float(repetition_penalty)
        self.eos = torch.tensor(list(eos_token_id), dtype=torch.long, device=device)
        # HF's processors for what depends only on the last tokens; they run on a short history
        self.sequence = LogitsProcessorList()
        if sequence_bias:
            self.sequence.append(SequenceBiasLogitsProcessor(sequence_bias=sequence_bias))
        if bad_words_ids:
            self.sequence_bad = NoBadWordsLogitsProcessor(
                bad_words_ids, self.eos if self.eos.numel() else None
            )
        else:
            self.sequence_bad = None
        lengths = [len(k) for k in _sequences(sequence_bias)] + [len(w) for w in bad_words_ids or []]
        context = max(lengths, default=1) - 1  # prompt tokens a sequence's prefix can reach
        if input_length is None:
            input_length = prompt_ids.numel() if prompt_ids is not None else 0
        self.input_length = input_length
        if (
            min_new_tokens is not None
        ):  # generate's _prepare_generated_length: min_new_tokens takes precedence
            min_length = min_new_tokens + input_length
        self.min_length, self.min_new_tokens = min_length or 0, min_new_tokens or 0
        needs_prompt = self.penalty != 1.0 or context > 0 or bool(no_repeat_ngram_size)
        if needs_prompt and prompt_ids is None:
            raise LongStrawError(
                "repetition_penalty, no_repeat_ngram_size and multi-token sequence_bias / bad_words_ids read the "
                "prompt: pass prompt_ids"
            )
        self.tail = torch.zeros(num_sequences, 0, dtype=torch.long, device=device)
        if context > 0:
            tail = prompt_ids[-context:].to(device)
            pad = min(context, input_length) - tail.numel()  # left padding the prefix may reach
            if pad > 0:
                tail = torch.cat([tail.new_full((pad,), pad_token_id), tail])
            self.tail = tail[None].expand(num_sequences, -1)
        self.seen = None
        if self.penalty != 1.0:
            prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt[prompt_ids.to(device)] = True
            self.seen = prompt[None].repeat(num_sequences, 1)  # [G, V]: prompt, then each row's own tokens
        self.ngram = None
        if no_repeat_ngram_size:
            # HF's processor on [left padding, prompt, generated]: n pads give every window padding can form
            n = int(no_repeat_ngram_size)
            pads = min(max(input_length - prompt_ids.numel(), 0), n)
            prompt = torch.cat([prompt_ids.new_full((pads,), pad_token_id), prompt_ids]).to(device)
            self.ngram = NoRepeatNGramLogitsProcessor(n)
            self.ngram_prompt = prompt[None].expand(num_sequences, -1)
        self.suppress = SuppressTokensLogitsProcessor(suppress_tokens, device) if suppress_tokens else None
        # masks as HF builds them (`isin` over the vocabulary: ids outside it are ignored, e.g. an EOS id past
        # the head's rows)
        vocab = torch.arange(vocab_size, device=device)
        self.begin = None
        if begin_suppress_tokens:
            self.begin = torch.isin(vocab, torch.tensor(list(begin_suppress_tokens), device=device))
        self.eos_mask = torch.isin(vocab, self.eos)

    def __call__(self, step: int, generated: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return scores
        history = torch.cat([self.tail, generated[:, :step]], dim=1)
        scores = self.sequence(history, scores)
        if self.seen is not None:  # RepetitionPenaltyLogitsProcessor over prompt + generated tokens
            penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
            scores = torch.where(self.seen, penalised, scores)
        if self.ngram is not None:
            scores = self.ngram(torch.cat([self.ngram_prompt, generated[:, :step]], dim=1), scores)
        if self.sequence_bad is not None:
            scores = self.sequence_bad(history, scores)
        if self.input_length + step < self.min_length or step < self.min_new_tokens:
            scores = torch.where(self.eos_mask, -math.inf, scores)
        if self.suppress is not None:
            scores = self.suppress(history, scores)
        if self.begin is not None and step == 0:
            scores = torch.where(self.begin, -math.inf, scores)
        return scores

    def append(self, tokens: torch.Tensor) -> None:
        """Record each sequence's new token ``[G]`` (in place, no host synchronisation)."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)


def _sequences(sequence_bias) -> list:
    if not sequence_bias:
        return []
    if isinstance(sequence_bias, dict):
        return list(sequence_bias)
    return [seq for seq, _ in sequence_bias]  # [[ids, bias], ...], as GenerationConfig stores it


@dataclass(frozen=True)
class SamplingParams:
    """The settings of a shared-prefix sampler call (:func:`generate_from_state`), built once from a trainer's
    sampling options and its ``generation_kwargs``; it owns which ``generation_kwargs`` are honoured (exactly as
    ``model.generate`` applies them), refused by name (unless set to the value that does nothing) or ignored
    (they do not change the samples).

    Args:
        max_new_tokens: completion tokens to sample at most.
        temperature, top_p, top_k, min_p, do_sample: transformers' warpers, in ``generate``'s order.
        eos_token_id: the id(s) that end a completion.
        pad_token_id: what follows a row's EOS.
        repetition_penalty, sequence_bias, bad_words_ids, no_repeat_ngram_size, min_length, min_new_tokens,
            suppress_tokens, begin_suppress_tokens: ``generate``'s logits processors (:class:`LogitsProcessing`).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    do_sample: bool = True
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    repetition_penalty: float = 1.0
    sequence_bias: Any = None
    bad_words_ids: Sequence[Sequence[int]] | None = None
    no_repeat_ngram_size: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    suppress_tokens: Sequence[int] | None = None
    begin_suppress_tokens: Sequence[int] | None = None

    # generation kwargs refused by name unless set to a value that does nothing: (no-op values, why)
    REFUSED: ClassVar[dict[str, tuple[tuple, str]]] = {
        "num_beams": ((None, 1), "beam search is not shared-prefix sampling"),
        "num_return_sequences": ((None, 1), "use num_generations"),
        "max_length": ((None,), "use max_completion_length (max_length counts the prompt)"),
        "typical_p": ((None, 1.0), "the sampler applies temperature, top_k, top_p and min_p only"),
        "epsilon_cutoff": ((None, 0.0), "the sampler applies temperature, top_k, top_p and min_p only"),
        "eta_cutoff": ((None, 0.0), "the sampler applies temperature, top_k, top_p and min_p only"),
        "top_h": ((None,), "the sampler applies temperature, top_k, top_p and min_p only"),
        "forced_bos_token_id": ((None,), "not implemented in the shared-prefix sampler"),
        "forced_eos_token_id": ((None,), "not implemented in the shared-prefix sampler"),
        "exponential_decay_length_penalty": ((None,), "not implemented in the shared-prefix sampler"),
        "renormalize_logits": ((None, False), "not implemented in the shared-prefix sampler"),
        "remove_invalid_values": ((None, False), "not implemented in the shared-prefix sampler"),
        "guidance_scale": ((None, 1.0), "classifier-free guidance needs a second, unconditional prompt"),
        "stop_strings": ((None,), "stop strings are decoded text; use eos_token_id"),
        "encoder_repetition_penalty": ((None, 1.0), "encoder-decoder models only"),
        "encoder_no_repeat_ngram_size": ((None, 0), "encoder-decoder models only"),
    }
    # ... and those that do not change the samples (accepted, ignored)
    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {"cache_implementation", "use_cache", "disable_compile", "return_dict_in_generate", "bos_token_id"}
    )

    @classmethod
    def honoured(cls) -> list[str]:
        """The ``generation_kwargs`` applied exactly as ``model.generate`` applies them."""
        return sorted(f.name for f in fields(cls))

    @classmethod
    def check_generation_kwargs(cls, generation_kwargs: dict | None) -> None:
        """Raise :class:`LongStrawError` for a kwarg the sampler cannot honour (naming it and what to do)."""
        extra = dict(generation_kwargs or {})
        for name, (noop, why) in cls.REFUSED.items():
            if name in extra and extra.pop(name) not in noop:
                raise LongStrawError(
                    f"LongStrawGRPOTrainer does not support generation_kwargs['{name}']. The shared-prefix sampler "
                    f"cannot honour it: {why}. Remove it."
                )
        unknown = sorted(set(extra) - set(cls.honoured()) - cls.IGNORED)
        if unknown:
            raise LongStrawError(
                f"LongStrawGRPOTrainer does not support generation_kwargs {unknown}. The shared-prefix sampler "
                f"honours {sorted(set(cls.honoured()) | {'bos_token_id'})}; remove the others."
            )

    @classmethod
    def from_settings(cls, generation_kwargs: dict | None, **defaults: Any) -> SamplingParams:
        """``defaults`` (a trainer's own options) overridden by the honoured ``generation_kwargs``."""
        gk = generation_kwargs or {}
        values = {f.name: gk.get(f.name, defaults.get(f.name, f.default)) for f in fields(cls)}
        values["repetition_penalty"] = values.get("repetition_penalty") or 1.0
        return cls(**values)

    def sampler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`generate_from_state` (all but ``max_new_tokens``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "max_new_tokens"}


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
    *,
    repetition_penalty: float = 1.0,
    prompt_ids: torch.Tensor | None = None,
    input_length: int | None = None,
    sequence_bias=None,
    bad_words_ids: Sequence[Sequence[int]] | None = None,
    no_repeat_ngram_size: int | None = None,
    min_length: int | None = None,
    min_new_tokens: int | None = None,
    suppress_tokens: Sequence[int] | None = None,
    begin_suppress_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Sample ``[G, <= max_new_tokens]`` completion ids continuing ``state``'s prompt.

    Rows that emit an EOS token are padded with ``pad_token_id`` afterwards (default: the first EOS id);
    decoding stops once every row has finished (checked every ``DONE_CHECK_INTERVAL`` steps, so the
    generator may have drawn a few more tokens than ``model.generate`` would; the output is the same).
    ``do_sample=False`` is greedy. ``cuda_graphs``: replay each decode step as one CUDA graph (default:
    on CUDA, unless a step streams offloaded state (:meth:`LayerState.decode_streams`) or the state is spread
    over context-parallel ranks; see :class:`DecodeStep`).

    ``repetition_penalty``, ``no_repeat_ngram_size``, ``sequence_bias``, ``bad_words_ids``, ``min_length``,
    ``min_new_tokens``, ``suppress_tokens`` and ``begin_suppress_tokens`` mean what they mean to
    ``model.generate`` on the prompt (see :class:`LogitsProcessing`, which also explains ``prompt_ids`` and
    ``input_length``; the repetition penalty, n-grams and multi-token sequences need ``prompt_ids``).
    """
    _check_request(state, model, num_generations, max_new_tokens, do_sample, temperature, prompt_ids)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    warp = _warpers(temperature, top_k, top_p, min_p) if do_sample else LogitsProcessorList()
    g, device = num_generations, state.device
    process = LogitsProcessing(
        vocab_size(model),
        g,
        device,
        eos,
        pad_token_id,
        prompt_ids,
        state.num_tokens if input_length is None else input_length,
        repetition_penalty,
        sequence_bias,
        bad_words_ids,
        no_repeat_ngram_size,
        min_length,
        min_new_tokens,
        suppress_tokens,
        begin_suppress_tokens,
    )
    eos_t = torch.tensor(eos, device=device, dtype=torch.long)
    out = torch.full((g, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    decode = DecodeStep(model, state, g, max_new_tokens, cuda_graphs)

    def scores(step: int, logits: torch.Tensor) -> torch.Tensor:  # generate's order: processors, then warpers
        return warp(out[:, :step], process(step, out, logits))

    return _decode_tokens(
        state, decode, out, scores, process.append, eos_t, do_sample, generator, pad_token_id
    )


def _check_request(
    state: PromptState,
    model,
    num_generations: int,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float | None,
    prompt_ids: torch.Tensor | None,
) -> None:
    """Refuse a sampling request :func:`generate_from_state` cannot serve, saying why."""
    state.check_not_empty()
    if num_generations < 1 or max_new_tokens < 1:
        raise LongStrawError("num_generations and max_new_tokens must be >= 1")
    if do_sample and (temperature is None or temperature <= 0):
        raise LongStrawError(f"temperature must be > 0 when sampling, got {temperature}")
    check_max_position_embeddings(model, state.num_tokens + max_new_tokens, "prompt + max_new_tokens")
    if prompt_ids is not None and (prompt_ids.dim() != 1 or prompt_ids.numel() != state.num_tokens):
        raise LongStrawError(
            f"prompt_ids must be the state's 1-D prompt of {state.num_tokens} tokens, got shape "
            f"{tuple(prompt_ids.shape)}"
        )


def _decode_tokens(
    state: PromptState,
    decode: DecodeStep,
    out: torch.Tensor,
    scores: Callable[[int, torch.Tensor], torch.Tensor],
    record: Callable[[torch.Tensor], None],
    eos_t: torch.Tensor,
    do_sample: bool,
    generator: torch.Generator | None,
    pad_token_id: int,
) -> torch.Tensor:
    """The decode loop: each step's logits (``decode``) turned into ``scores(step, logits)``, the next tokens drawn
    into ``out [G, max_new_tokens]`` (``pad_token_id`` after a row's EOS) and handed to ``record``; stops once every
    row has finished (checked every ``DONE_CHECK_INTERVAL`` steps), trimmed to what stopping at once would keep."""
    g, max_new_tokens = out.shape
    has_eos = eos_t.numel() > 0
    done = torch.zeros(g, dtype=torch.bool, device=out.device)
    # The first step runs the last prompt token (the state holds the first P - 1), then each new token.
    tokens = state.last_token.view(1, 1).expand(g, 1)
    for step in range(max_new_tokens):
        nxt = _draw(scores(step, decode(tokens).float()), do_sample, generator, state.cp_group)
        nxt = torch.where(done, pad_token_id, nxt)
        out[:, step] = nxt
        record(nxt)
        if has_eos:
            done |= torch.isin(nxt, eos_t)
            if (step + 1) % DONE_CHECK_INTERVAL == 0 and bool(done.all()):
                return out[:, : _width(out, step, eos_t)]
        tokens = nxt[:, None]
    if has_eos and bool(done.all()):
        return out[:, : _width(out, max_new_tokens - 1, eos_t)]
    return out


def _draw(
    scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None, cp_group: Any
) -> torch.Tensor:
    """Each row's next token from its processed scores: a ``torch.multinomial`` draw, or greedy; the same tokens on
    every context-parallel rank."""
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
    else:
        nxt = scores.argmax(-1)
    if cp_group is not None:
        # every CP rank must decode the same tokens (their logits can differ in the last bits)
        torch.distributed.broadcast(nxt, src=torch.distributed.get_global_rank(cp_group, 0), group=cp_group)
    return nxt


def _width(out: torch.Tensor, step: int, eos_t: torch.Tensor) -> int:
    """Columns up to the step on which the last row finished (what stopping at once would have kept)."""
    is_eos = torch.isin(out[:, : step + 1], eos_t)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), step)
    return int(first.max()) + 1


def decode_graphs_by_default(state: PromptState) -> bool:
    """Whether :class:`DecodeStep` replays the decode steps on ``state`` as one CUDA graph when not told: on
    CUDA, without context parallelism (collectives inside: kept eager), when no layer streams state from the
    host during a step (``LayerState.decode_streams``; an offloaded GLM-5 state streams none, its rows read by
    the GPU from mapped host memory), and unless ``LONGSTRAW_DISABLE=cuda_graphs``."""
    device = state.device
    return (
        device.type == "cuda"
        and state.cp_group is None
        and not any(layer.decode_streams(device) for layer in state.layers.values())
        and enabled(CUDA_GRAPHS_SWITCH)
    )


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
            cuda_graphs = decode_graphs_by_default(state)
        if cuda_graphs and device.type != "cuda":
            raise LongStrawError("cuda_graphs=True needs the state on a CUDA device")
        self.model, self.state, self.use_graphs = model, state, cuda_graphs
        self.step = torch.zeros((), dtype=torch.long, device=device)  # tokens decoded so far
        self.ctx = ForwardContext(Mode.DECODE, state, capacity=capacity, step=self.step)
        self.tokens = torch.zeros(num_sequences, 1, dtype=torch.long, device=device)
        self.graph = None
        self.logits: torch.Tensor | None = None
        self.replay_streamed = 0  # host bytes a replay copies (the capture counted them once, moving none)

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
        streamed = streamed_bytes()
        try:
            with torch.cuda.graph(graph), torch.autocast(**autocast):
                logits = self._run()  # recorded, not run: nothing changes until a replay
        except Exception as err:  # noqa: BLE001 - any capture failure: decode eagerly
            logger.warning("decode steps run eagerly: CUDA graph capture failed (%s)", err)
            self.use_graphs = False
            return
        finally:
            self.replay_streamed = streamed_bytes() - streamed
            count_streamed_bytes(-self.replay_streamed)
        self.graph, self.logits = graph, logits

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
            count_streamed_bytes(self.replay_streamed)
            return self.logits
        logits = self._run()
        if self.use_graphs:  # the first eager step allocated every buffer the graph reuses
            self._capture()
        return logits
