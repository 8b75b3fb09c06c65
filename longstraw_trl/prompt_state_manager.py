"""The GRPO step's prompt states: every capture, extension and lookup of one trainer, with their refresh bookkeeping.

:class:`PromptStateManager` owns the prompt-state cache (:class:`~longstraw_trl.state_cache.PromptStateCache`) and its
lifecycle within a GRPO step: the states of a generation batch's groups are acquired (reused, extended from a cached
prefix, or captured, as the refresh policy decides) when the batch is generated, pinned until it has been consumed,
looked up again by the loss, and probed for drift (``adaptive``). Tool turns borrow the cache for their rollouts'
extended states and drop them when TRL's tool loop ends. No TRL and no Accelerator here: the host (the trainer, or a
plain object in the tests) supplies the graph-free context, the phase, the global step and the metrics sink
(:class:`StepHost`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import defaultdict
from typing import Protocol

import torch
from torch import nn

from .engine import DEFAULT_CHUNK_SIZE, capture_prompt, extend_state, replay_logprobs
from .errors import LongStrawError
from .host_memory import DeviceShare
from .options import CaptureOptions
from .prompt_state import PromptState
from .refresh import PROBE, RECAPTURE, RefreshPolicy
from .router_aux import RouterLoadBalancing, RouterStats
from .state_cache import CAPTURE, EXTEND, CachedPrompt, PromptStateCache, branch_prefixes, prompt_key

__all__ = ["CaptureOptions", "PromptStateManager", "StepHost", "peak_memory_gib"]

logger = logging.getLogger(__name__)


class StepHost(Protocol):
    """What the GRPO step objects need from whoever runs them (the trainer)."""

    @property
    def phase(self) -> str:
        """``"train"`` or ``"eval"``."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (the refresh policy's clock)."""

    @property
    def device(self) -> torch.device:
        """Where the loss lives."""

    def phase_metrics(self) -> dict[str, list[float]]:
        """The metrics of the current phase (name -> values logged this step)."""

    def graph_free(self, model: nn.Module, cast_adapters: bool = False) -> contextlib.AbstractContextManager:
        """The context of a pass without autograd (capture, generation, old/reference log-probs)."""


def peak_memory_gib(device: torch.device) -> float | None:
    """CUDA: peak allocated memory of the device; CPU: peak resident set size of the process (GiB)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux
    except (ImportError, OSError):
        return None


class PromptStateManager:
    """The prompt states of one trainer: captured once per group, reused or refreshed across steps.

    Args:
        host: the phase, global step, metrics and graph-free context (:class:`StepHost`).
        model: the policy.
        options: how prompts are captured (:class:`CaptureOptions`).
        refresh_policy: when a cached state is re-captured.
        cache_bytes: bytes of unpinned states kept between batches (``None``: no limit).
        router_aux: the MoE load-balancing loss, whose prompt statistics each policy capture records.

    Attributes:
        cache: the :class:`PromptStateCache`.
        batch_groups: while a generation batch is generated and scored, the prompt key of each of its groups in
            order (``None`` otherwise).
        tool_turn_keys: while TRL's tool loop runs, the keys of the tool turns' states (``None`` otherwise).
        train_keys: the keys of the training batch's groups (kept while evaluation runs).
    """

    def __init__(
        self,
        host: StepHost,
        model: nn.Module,
        options: CaptureOptions,
        refresh_policy: RefreshPolicy,
        cache_bytes: int | None = None,
        router_aux: RouterLoadBalancing | None = None,
    ):
        self.host, self.model, self.options = host, model, options
        self.refresh_policy = refresh_policy
        self.router_aux = router_aux
        # a common prefix shorter than a capture chunk is not worth a branch (nor a trunk)
        self.min_branch_tokens = options.capture_chunk_size or DEFAULT_CHUNK_SIZE
        self.cache = PromptStateCache(
            self.capture_policy,
            self.extend,
            refresh_policy,
            cache_bytes,
            prompt_prefix_sharing=options.prompt_prefix_sharing.cached_branches,
            min_branch_tokens=self.min_branch_tokens,
        )
        self.batch_groups: list[str] | None = None
        #: offloaded states: the device share whole layers of this batch's policy captures stay within (the trainer's
        #: pre-flight plan sets it per batch; ``None``: every offloadable layer in host memory)
        self.device_share: DeviceShare | None = None
        self.tool_turn_keys: set[str] | None = None
        self.train_keys: set[str] = set()
        self._router_prompt_stats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._counts: dict[str, dict[str, float]] = {"train": defaultdict(float), "eval": defaultdict(float)}

    # --- capture and extension --------------------------------------------------------------------------------------
    def capture(self, model: nn.Module, prompt_ids: torch.Tensor, role: str = "policy") -> PromptState:
        """Capture one prompt (1-D token ids) with ``model``: every capture of the trainer goes through here.

        ``role`` (``"policy"`` or ``"reference"``): a policy capture keeps the full gradient's boundaries and the
        router statistics; the role is logged.
        """
        start = time.perf_counter()
        collect = self.router_aux is not None and role == "policy"
        router_stats = self.router_aux.collect() if collect else contextlib.nullcontext()
        with self.host.graph_free(model, cast_adapters=True), router_stats as stats:
            state = capture_prompt(
                model,
                prompt_ids,
                chunk_size=self.options.capture_chunk_size,
                page_size=self.options.page_size,
                offload_prompt_state=self.options.offload_prompt_state,
                cp_group=self.options.cp_group,
                # sharing: the boundaries are where a later prompt may branch off this one's fixed-size states
                keep_boundaries=self.options.keep_boundaries and role == "policy",
                device_share=self.device_share if role == "policy" else None,
            )
        if collect:  # the router statistics of the P - 1 captured tokens (none for a one-token prompt)
            self._router_prompt_stats[state] = stats[0] if stats else self._no_router_stats(state.device)
        seconds = time.perf_counter() - start
        metrics = self.host.phase_metrics()
        metrics["longstraw/capture_seconds"].append(seconds)
        metrics["longstraw/capture_tokens_per_second"].append(state.num_tokens / max(seconds, 1e-9))
        metrics["longstraw/prompt_tokens"].append(float(state.num_tokens))
        peak = peak_memory_gib(self.host.device)
        if peak is not None:  # the step's peak so far: its captures come first, so this is theirs
            metrics["longstraw/capture_peak_memory_gib"].append(peak)
        for kind, nbytes in state.nbytes_by_kind().items():
            metrics[f"longstraw/state_bytes/{kind}"].append(float(nbytes))
        if state.boundaries:  # the fixed-size states kept at chunk boundaries (their own tensors: snapshots)
            kept = sum(layer.nbytes() for at in state.boundaries.values() for layer in at.values())
            metrics["longstraw/state_bytes/kept_boundaries"].append(float(kept))
        logger.info(
            "LongStraw: captured a %d-token prompt (%s) in %.2fs: %s", state.num_tokens, role, seconds, state
        )
        return state

    def capture_policy(self, prompt_ids: torch.Tensor) -> PromptState:
        return self.capture(self.model, prompt_ids)

    def extend(self, state: PromptState, more_ids: torch.Tensor) -> PromptState:
        """A fork of ``state`` with ``more_ids`` appended (the prompt-state cache's prefix reuse)."""
        start = time.perf_counter()
        with self.host.graph_free(self.model, cast_adapters=True):
            new = extend_state(state, self.model, more_ids)
        metrics = self.host.phase_metrics()
        metrics["longstraw/extend_seconds"].append(time.perf_counter() - start)
        metrics["longstraw/extend_tokens"].append(float(more_ids.numel()))
        return new

    def router_prompt_stats(self, entry: CachedPrompt) -> RouterStats:
        """The router statistics of a policy state's captured prompt tokens (the load-balancing loss)."""
        stats = self._router_prompt_stats.get(entry.state)
        if stats is None:
            raise LongStrawError(
                f"prompt {entry.key} has no router statistics: its state was captured without the trainer's "
                "router hooks"
            )
        return stats

    def _no_router_stats(self, device) -> RouterStats:
        zeros = torch.zeros(self.router_aux.num_experts, device=device)
        return RouterStats(zeros, zeros.clone(), torch.zeros((), device=device))

    # --- lookups ------------------------------------------------------------------------------------------------------
    def acquire(self, key: str, prompt_ids, purpose: str) -> CachedPrompt:
        """The policy state of a prompt: reused, extended from a cached prefix, or captured (refresh policy)."""
        counts = self._counts[self.host.phase]
        entry, action, age = self.cache.get(prompt_ids, self.host.global_step, key)
        counts[action] += 1
        if age is not None:
            counts["_age_sum"] += age
            counts["_age_n"] += 1
        logger.info("LongStraw refresh: prompt %s (%s) age %s -> %s", key, purpose, age, action)
        return entry

    def __getitem__(self, key: str) -> CachedPrompt:
        return self.cache[key]

    def group_rows(self, prompt_ids: list, num_generations: int) -> list:
        """The prompt of each group of ``num_generations`` consecutive rows (which must share it)."""
        if len(prompt_ids) % num_generations != 0:
            raise LongStrawError(
                f"got {len(prompt_ids)} rows, not a multiple of num_generations={num_generations}: every prompt must "
                "come with its whole group of completions."
            )
        groups = []
        for start in range(0, len(prompt_ids), num_generations):
            first = prompt_ids[start]
            for row in range(start + 1, start + num_generations):
                if not (prompt_ids[row] is first or list(prompt_ids[row]) == list(first)):
                    raise LongStrawError(
                        f"rows {start}..{start + num_generations - 1} should be one group (one prompt repeated "
                        f"num_generations={num_generations} times, as TRL's RepeatSampler yields them), but row {row} "
                        "has another prompt. Use the trainer's own dataloader/sampler; an environment's reset() must "
                        "give the rollouts of one row the same observation; a rollout_func must return the rows of "
                        "a prompt consecutively, with identical prompt_ids."
                    )
            groups.append(first)
        return groups

    def acquire_groups(self, prompt_ids, num_generations: int) -> tuple[list[str], dict[str, CachedPrompt]]:
        """The prompt state of each group of ``num_generations`` rows, recorded in :attr:`batch_groups` (the groups
        of the old/reference log-probs and of the loss); the cache is pinned to this batch's prompts first."""
        if self.batch_groups is None:
            raise RuntimeError(
                "LongStrawGRPOTrainer: generation must go through _generate_and_score_completions"
            )
        phase = self.host.phase
        groups = self.group_rows(prompt_ids, num_generations)
        keys = [prompt_key(ids) for ids in groups]
        trunks = []
        if self.options.batch_trunks:  # the common prefixes at which this batch's prompts branch
            prompts = [torch.as_tensor(ids).reshape(-1).cpu() for ids in groups]
            trunks = branch_prefixes(prompts, min_tokens=self.min_branch_tokens)
        trunk_keys = [prompt_key(ids) for ids in trunks]
        keep = set(keys) | set(trunk_keys) | (self.train_keys if phase == "eval" else set())
        # before capturing: free what will not be used (the old batch's states beyond the cache's budget)
        self.cache.pin(keep)
        self.cache.evict(self.host.global_step)
        if phase == "train":
            self.train_keys = set(keys)

        # each trunk once, shortest first (a deeper trunk extends a shallower one): the prompts branch off them
        counts = self._counts[phase]
        for key, ids in zip(trunk_keys, trunks, strict=True):
            _, action, _ = self.cache.get(ids, self.host.global_step, key)
            counts["_trunks"] += 1
            logger.info("LongStraw prefix sharing: trunk %s of the batch -> %s", key, action)
        # shortest prompts first, so a prompt that extends another one of this batch finds its state
        entries = {}
        for i in sorted(range(len(groups)), key=lambda i: len(groups[i])):
            if keys[i] not in entries:
                entries[keys[i]] = self.acquire(keys[i], groups[i], purpose="generation")
        self.batch_groups.extend(keys)
        return keys, entries

    def finish_probe(
        self, entry: CachedPrompt, ids: torch.Tensor, mask: torch.Tensor, temperature: float
    ) -> None:
        """``adaptive`` probe: drift of one response's log-probs between the stale and the fresh state."""
        stale, entry.probe_stale = entry.probe_stale, None
        n = int(mask.sum())
        if stale is None or n == 0:
            return
        ids, mask = ids[None, :n], mask[None, :n]
        with self.host.graph_free(self.model):
            old = replay_logprobs(stale, self.model, ids, mask, temperature)
            new = replay_logprobs(entry.state, self.model, ids, mask, temperature)
        drift = (old - new).abs().mean().item()
        interval = self.refresh_policy.record_drift(drift)
        self.host.phase_metrics()["longstraw/refresh/drift"].append(drift)
        logger.info(
            "LongStraw refresh: prompt %s drift %.4g nats/token, interval now %d", entry.key, drift, interval
        )

    def batch_logprobs(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        temperature: float,
        reference: bool = False,
    ) -> torch.Tensor:
        """``[B, R]`` log-probs of the generation batch's completions (rows in :attr:`batch_groups` order, zero on
        padding) as graph-free replays on each group's state: the old policy's, or, with ``reference``, a capture of
        each group's prompt by ``model`` (the reference model, or the policy with its adapters off)."""
        groups = self.batch_groups
        size = ids.size(0) // len(groups)
        out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        start = time.perf_counter()
        for g, key in enumerate(groups):
            rows = slice(g * size, (g + 1) * size)
            length = int((mask[rows].sum(0) > 0).sum())  # right padding: the longest row of the group
            if length == 0:
                continue
            entry = self.cache[key]
            state = self.capture(model, entry.prompt_ids, role="reference") if reference else entry.state
            with self.host.graph_free(model):
                logps = replay_logprobs(state, model, ids[rows, :length], mask[rows, :length], temperature)
            out[rows, :length] = logps.to(out.device) * mask[rows, :length]
            del state, logps
        self.host.phase_metrics()["longstraw/logprob_replay_seconds"].append(time.perf_counter() - start)
        return out

    # --- batches and tool turns ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def generation_batch(self):
        """While a generation batch is generated and scored: its groups are recorded in :attr:`batch_groups`
        (yielded, complete when the block ends)."""
        self.batch_groups = groups = []
        try:
            yield groups
        finally:
            self.batch_groups = None

    @contextlib.contextmanager
    def tool_turns(self):
        """While TRL's tool loop runs: its generation calls are tool turns (one row per rollout). The states the turns
        create are dropped from the cache at the end: the loss replays every rollout on its group's prompt state,
        and a sampled history is not a prompt a later batch asks for."""
        before = set(self.cache.entries)
        self.tool_turn_keys = set()
        try:
            yield
        finally:
            created, self.tool_turn_keys = self.tool_turn_keys - before, None
            self.cache.drop(created)

    def end_eval(self) -> None:
        """Evaluation states are not kept (the training batch's are)."""
        self.cache.drop(self.cache.pinned - self.train_keys)
        self.cache.pin(self.train_keys)

    # --- bookkeeping --------------------------------------------------------------------------------------------------
    def flush_counts(self, phase: str, metrics: dict[str, list[float]]) -> None:
        """Log the phase's refresh actions, reuse and state age since the last flush."""
        counts = self._counts[phase]
        for action in (CAPTURE, EXTEND, "fresh", "reuse", RECAPTURE, PROBE):
            metrics[f"longstraw/refresh/{action}"].append(counts.get(action, 0.0))
        metrics["longstraw/prefix_trunks"].append(counts.get("_trunks", 0.0))
        for name, tokens in self.cache.pop_stats().items():
            metrics[f"longstraw/{name}"].append(float(tokens))
        if counts.get("_age_n"):
            metrics["longstraw/refresh/state_age"].append(counts["_age_sum"] / counts["_age_n"])
        metrics["longstraw/refresh/interval"].append(float(self.refresh_policy.interval))
        counts.clear()

    def free(self) -> None:
        """Drop every captured prompt state (they are re-captured when needed)."""
        self.cache.clear()
        self.train_keys = set()

    # --- checkpoints --------------------------------------------------------------------------------------------------
    def checkpoint_summary(self) -> dict:
        """What a checkpoint leaves out of the cache: the states held now (count, prompt tokens, bytes, and the
        steps that captured them). Checkpoints hold no prompt state (a million-token state is gigabytes); a resume
        re-captures each prompt at its next use (:meth:`resume`)."""
        held = [e for e in self.cache.entries.values() if e.state is not None]
        return {
            "saved": False,
            "states": len(held),
            "tokens": sum(int(e.prompt_ids.numel()) for e in held),
            "bytes": self.cache.nbytes(),
            "captured_at": sorted({int(e.captured_at) for e in held}),
        }

    def resume(self, checkpoint: str, step: int, summary: dict | None) -> None:
        """Resuming from ``checkpoint`` (optimizer step ``step``): start with an empty cache, and say what that
        changes. Under ``recapture`` nothing: no state is used in a step after the one that captured it. Under
        ``reuse`` / ``adaptive`` the states the checkpoint left out (``summary``, from :meth:`checkpoint_summary`)
        are captured again, with the restored weights, where the uninterrupted run would have reused them stale:
        the resumed run is the uninterrupted run with its cache cleared after step ``step``, not that run itself."""
        self.free()
        policy = self.refresh_policy.policy
        if summary is None:
            logger.warning(
                "LongStraw resume from %s (step %d): the checkpoint has no prompt-cache record (saved by another "
                "trainer or an older version); prompt states start empty and every prompt is captured again at its "
                "next use.",
                checkpoint,
                step,
            )
            return
        states = int(summary.get("states", 0))
        if policy == "recapture" or states == 0:
            logger.info(
                "LongStraw resume from %s (step %d): no prompt state crosses a step under refresh_policy=%r: the "
                "resumed run equals the uninterrupted one.",
                checkpoint,
                step,
                policy,
            )
            return
        logger.warning(
            "LongStraw resume from %s (step %d): checkpoints hold no prompt state; the %d state(s) cached when it was "
            "saved (%d prompt tokens, %.3g MiB, captured at step(s) %s) are captured again, with the restored "
            "weights, at their next use. Under refresh_policy=%r the uninterrupted run would have reused them "
            "stale: from here the run equals an uninterrupted one whose prompt cache was cleared after step %d, not "
            "that run itself (the refresh policy's counters, interval and drift history are restored).",
            checkpoint,
            step,
            states,
            int(summary.get("tokens", 0)),
            int(summary.get("bytes", 0)) / 2**20,
            ", ".join(str(s) for s in summary.get("captured_at", ())) or "-",
            policy,
            step,
        )

    def nbytes(self) -> int:
        """Bytes of the prompt states held (forks' shared pages counted once)."""
        return self.cache.nbytes()
