"""The trainer's prompt states: one per prompt, found by longest cached prefix, kept within a byte budget.

An agent's history grows turn by turn: the prompt of a decision point is the prompt of the previous one plus
the turns since. :class:`PromptStateCache` looks a prompt up by its tokens. An exact match is reused (or
re-captured) under the :class:`~longstraw_trl.refresh.RefreshPolicy`; otherwise the longest cached prompt that
is a prefix of it, if its state may still be used, is *extended* (``PromptState.extend``: a fork that shares
the prefix's K/V segments and prefills only the new tokens); only when no prefix is usable is the prompt
captured from its first token. With ``prompt_prefix_sharing`` any common prefix counts, not only a whole cached prompt:
the new prompt branches off the cached state after the shared tokens (K/V pages: a prefix view, no copy;
fixed-size layers such as GDN or a sliding window: the state kept at the last capture-chunk boundary before the
branch, :meth:`PromptState.branch_point`). :func:`branch_prefixes` gives the trunks of a batch's prompt trie,
which the caller looks up first so that every shared token is prefilled once.

Staleness: a state extended from a prefix holds the prefix's part as the prefix's weights saw it, so its age
is the prefix's (``captured_at`` is inherited), and the refresh policy treats it as that old. A re-capture of
a stale state looks for a *fresh* prefix (captured with the current weights) to extend before capturing
everything again.

Memory: states of the prompts in use are pinned (``pin``); the others are kept, least recently used first to
go, while the bytes the cache holds stay within ``max_bytes`` (counted once per tensor: forks share their
prefix's segments and the boundary states kept for branching). ``max_bytes=0`` keeps nothing between batches
(every batch starts from captures).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .prompt_state import PromptState
from .refresh import PROBE, RECAPTURE, RefreshPolicy

logger = logging.getLogger(__name__)

CAPTURE, EXTEND = "capture", "extend"


def prompt_key(ids: list[int] | torch.Tensor) -> str:
    """A short identity of a token sequence (hash of its ids and its length)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
    digest = hashlib.blake2b(t.to(torch.int64).cpu().numpy().tobytes(), digest_size=8).hexdigest()
    return f"{digest}:{t.numel()}"


@dataclass
class CachedPrompt:
    """One prompt of the cache: its token ids (to re-capture or extend it) and its current state.

    Attributes:
        key: :func:`prompt_key` of ``prompt_ids``.
        prompt_ids: 1-D LongTensor on the CPU.
        state: the prompt state, ``None`` once freed (it is rebuilt when needed).
        captured_at: the optimizer step whose weights captured the oldest part of the state.
        probe_stale: ``"adaptive"`` refresh: the stale state kept until the drift is measured.
        last_used: the cache's clock at the last lookup (least recently used states are evicted first).
        built_at: the optimizer step whose lookup built the current state (captured or extended it).
        reused_at: the last step whose lookups counted the state's tokens as reused (once a step).
    """

    key: str
    prompt_ids: torch.Tensor
    state: PromptState | None
    captured_at: int
    probe_stale: PromptState | None = None
    last_used: int = 0
    built_at: int = 0
    reused_at: int | None = None
    parent: str | None = field(default=None, repr=False)  # the prefix it was extended from, if any


class Lookup(NamedTuple):
    """What :meth:`PromptStateCache.get` found: the entry, the action taken, the age decided on."""

    entry: CachedPrompt
    action: str
    age: int | None


def _state_tensors(state: PromptState) -> Iterable[torch.Tensor]:
    """The state's tensors and those of the layer states it kept at boundaries (GDN, windows: what a later
    prompt branching inside it starts from; forks share them, and :meth:`PromptStateCache.nbytes` counts each
    storage once)."""
    for layer in state.layers.values():
        yield from layer.tensors()
    for kept in (state.boundaries or {}).values():
        for layer in kept.values():
            yield from layer.tensors()


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens the 1-D id tensors ``a`` and ``b`` share."""
    n = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n


def branch_prefixes(prompts: list[torch.Tensor], min_tokens: int = 1) -> list[torch.Tensor]:
    """The trunks of the prompt trie of ``prompts`` (1-D id tensors): every common prefix at which two of them
    branch (both go on past it), at least ``min_tokens`` long, shortest first. Capturing each trunk once and
    extending it gives every prompt with each shared token prefilled once (a prompt that is a whole prefix of
    another is no trunk: the other extends it as it is).

    In lexicographic order the branch points of a trie are the common prefixes of neighbours."""
    order = sorted(prompts, key=lambda t: t.tolist())
    trunks: dict[str, torch.Tensor] = {}
    for a, b in zip(order, order[1:], strict=False):
        n = common_prefix_length(a, b)
        if min_tokens <= n < min(a.numel(), b.numel()):
            trunks.setdefault(prompt_key(a[:n]), a[:n])
    return sorted(trunks.values(), key=lambda t: t.numel())


class PromptStateCache:
    """Prompt states by longest cached prefix, under a refresh policy and a byte budget (module docstring).

    Args:
        capture: ``ids -> PromptState``: capture a whole prompt with the current weights.
        extend: ``(state, more_ids) -> PromptState``: a fork of ``state`` with ``more_ids`` appended.
        policy: when to re-capture a stale state.
        max_bytes: bytes of state kept beyond the pinned ones (``None``: no limit).
        min_reuse_tokens: shortest prefix worth extending (shorter ones are captured again).
        prompt_prefix_sharing: extend from any common prefix with a cached prompt (``False``: only from a cached prompt
            that is a whole prefix of the new one); the trainer's ``prompt_prefix_sharing="all"``.
        min_branch_tokens: shortest common prefix worth branching off (a whole cached prefix needs only
            ``min_reuse_tokens``): a short one, e.g. a chat template's system turn, would tie the new state to an
            older one (its age, a second K/V segment) to save less than a chunk of prefill.
    """

    def __init__(
        self,
        capture: Callable[[torch.Tensor], PromptState],
        extend: Callable[[PromptState, torch.Tensor], PromptState],
        policy: RefreshPolicy,
        max_bytes: int | None = None,
        min_reuse_tokens: int = 1,
        prompt_prefix_sharing: bool = False,
        min_branch_tokens: int = 1,
    ):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self._capture, self._extend, self.policy = capture, extend, policy
        self.max_bytes, self.min_reuse_tokens = max_bytes, max(1, min_reuse_tokens)
        self.prompt_prefix_sharing, self.min_branch_tokens = prompt_prefix_sharing, min_branch_tokens
        self.entries: dict[str, CachedPrompt] = {}
        self.pinned: set[str] = set()
        self._clock = 0
        self.tokens_captured = 0  # prompt tokens prefilled (whole captures and extensions), since `pop_stats`
        # prompt tokens served without prefill: an exact hit on a state built in an earlier step (counted once a
        # step: the loss's lookups of the state its own step captured or already served are not reuse), and the
        # prefix of an extension
        self.tokens_reused = 0

    # --- lookup -----------------------------------------------------------------------------------------------------
    def get(
        self, ids: torch.Tensor | list[int], step: int, key: str | None = None
    ) -> tuple[CachedPrompt, str]:
        """The state of prompt ``ids`` at optimizer step ``step``, and what was done to get it: ``"capture"``,
        ``"extend"``, or the refresh policy's ``"fresh"`` / ``"reuse"`` / ``"recapture"`` / ``"probe"``."""
        ids = torch.as_tensor(ids).detach().to("cpu", torch.long).reshape(-1)
        key = key or prompt_key(ids)
        self._clock += 1
        entry = self.entries.get(key)
        if entry is not None and entry.state is not None:
            entry.last_used = self._clock
            decision = self.policy.decide(step - entry.captured_at)
            if not decision.needs_capture:
                if entry.built_at < step and entry.reused_at != step:
                    self.tokens_reused += ids.numel()
                    entry.reused_at = step
                return Lookup(entry, decision.action, decision.age)
            stale, entry.state = entry.state, None
            entry.probe_stale = stale if decision.action == PROBE else None
            del stale
            self._build(entry, step, fresh_only=True)
            return Lookup(entry, decision.action, decision.age)
        first = entry is None
        if first:
            entry = self.entries[key] = CachedPrompt(key, ids, None, step)
        entry.last_used = self._clock
        action = self._build(entry, step, fresh_only=not first)
        return Lookup(entry, action if first else RECAPTURE, None if first else step - entry.captured_at)

    def _usable_source(
        self, entry: CachedPrompt, step: int, fresh_only: bool
    ) -> tuple[CachedPrompt, int] | None:
        """The cached prompt whose state serves most of ``entry``'s tokens and may be used now, and that many
        resident tokens ``b`` (its state after them, with token ``b`` as the last, is extended by the rest). Any
        common prefix counts, not only a whole cached prompt; a state whose layers cannot be rewound (GDN, a
        sliding window) branches at the last boundary it kept (:meth:`PromptState.branch_point`)."""
        ids, best = entry.prompt_ids, None
        for other in self.entries.values():
            if other is entry or other.state is None:
                continue
            age = step - other.captured_at
            if age > 0 and (fresh_only or self.policy.policy == "recapture" or age > self.policy.interval):
                continue
            shared = common_prefix_length(other.prompt_ids, ids)
            whole = shared == other.prompt_ids.numel()
            if not whole and (not self.prompt_prefix_sharing or shared < self.min_branch_tokens):
                continue  # exact prefixes only, or too short a branch
            # at least one token of `ids` is left to extend (a prompt inside a cached one re-runs its last)
            tokens = other.state.branch_point(min(shared, ids.numel() - 1) - 1)
            if tokens == 0 or tokens + 1 < self.min_reuse_tokens:
                continue
            if best is None or tokens > best[1]:
                best = (other, tokens)
        return best

    def _build(self, entry: CachedPrompt, step: int, fresh_only: bool) -> str:
        found = self._usable_source(entry, step, fresh_only)
        if found is None:
            entry.state = self._capture(entry.prompt_ids)
            entry.captured_at, entry.built_at, entry.parent = step, step, None
            self.tokens_captured += entry.prompt_ids.numel()
            return CAPTURE
        source, tokens = found
        n = (
            tokens + 1
        )  # prompt tokens served by the source's state: `tokens` resident, then the last one's id
        source.last_used = self._clock
        base = source.state
        if tokens < base.resident_tokens:  # a branch inside the source: K/V pages shared up to it, no copy
            base = base.prefix_state(tokens, entry.prompt_ids[tokens])
        entry.state = self._extend(base, entry.prompt_ids[n:])
        entry.captured_at, entry.built_at, entry.parent = source.captured_at, step, source.key
        self.tokens_reused += n
        self.tokens_captured += entry.prompt_ids.numel() - n
        logger.info(
            "LongStraw cache: prompt %s extends the first %d tokens of %s by %d tokens",
            entry.key,
            n,
            source.key,
            entry.prompt_ids.numel() - n,
        )
        return EXTEND

    def __getitem__(self, key: str) -> CachedPrompt:
        return self.entries[key]

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    # --- memory -----------------------------------------------------------------------------------------------------
    def pin(self, keys: Iterable[str]) -> None:
        """The prompts the current batch uses: never evicted until the next ``pin``."""
        self.pinned = set(keys)

    def nbytes(self, keys: Iterable[str] | None = None, beyond: Iterable[str] = ()) -> int:
        """Bytes held by the states of ``keys`` (default: all), each tensor counted once (forks share their
        prefix's K/V and the boundary states kept for branching); with ``beyond``, only the bytes the states of
        ``beyond`` do not already hold."""
        seen, total = set(), 0
        for counted, group in ((False, beyond), (True, self.entries if keys is None else keys)):
            for key in group:
                entry = self.entries.get(key)
                for state in (entry.state, entry.probe_stale) if entry is not None else ():
                    if state is None:
                        continue
                    for t in _state_tensors(state):
                        ptr = t.untyped_storage().data_ptr()
                        if ptr not in seen:
                            seen.add(ptr)
                            total += t.untyped_storage().nbytes() if counted else 0
        return total

    def evict(self, step: int, keep: Iterable[str] = ()) -> None:
        """Before a batch: free states the refresh policy would not use again (every stale state under
        ``"recapture"``; unkept ones past the reuse interval otherwise), forget prompts with no state that are
        not kept, then drop the least recently used unkept states while they hold more than ``max_bytes``.
        ``keep`` (and the pinned prompts) are never dropped."""
        keep = set(keep) | self.pinned
        for entry in self.entries.values():
            age = step - entry.captured_at
            if entry.state is None or age == 0:
                continue
            if self.policy.policy == "recapture" or (entry.key not in keep and age > self.policy.interval):
                entry.state = entry.probe_stale = None
        for key in [k for k, e in self.entries.items() if e.state is None and k not in keep]:
            del self.entries[key]
        if self.max_bytes is None:
            return
        unkept = sorted((e for e in self.entries.values() if e.key not in keep), key=lambda e: e.last_used)
        kept = [k for k in self.entries if k in keep]
        # what the unkept states hold beyond the kept ones (a trunk whose pages the batch's forks share costs
        # only its own boundary states)
        held = self.nbytes([e.key for e in unkept], beyond=kept)
        while unkept and held > self.max_bytes:
            del self.entries[unkept.pop(0).key]
            held = self.nbytes([e.key for e in unkept], beyond=kept)

    def drop(self, keys: Iterable[str]) -> None:
        """Forget these prompts and their states now (an evaluation batch's, the per-rollout states of a tool loop)."""
        for key in keys:
            self.entries.pop(key, None)
            self.pinned.discard(key)

    def clear(self) -> None:
        self.entries.clear()
        self.pinned = set()

    def pop_stats(self) -> dict[str, int]:
        """Prompt tokens prefilled (``tokens_captured``: captures and extensions) and served without prefill
        (``tokens_reused``: states built in an earlier step, once a step, and extensions' prefixes) since the last
        call."""
        out = {"tokens_captured": self.tokens_captured, "tokens_reused": self.tokens_reused}
        self.tokens_captured = self.tokens_reused = 0
        return out


__all__ = [
    "CAPTURE",
    "EXTEND",
    "CachedPrompt",
    "Lookup",
    "PromptStateCache",
    "branch_prefixes",
    "common_prefix_length",
    "prompt_key",
]
