"""The prompt-state cache: longest-prefix reuse, inherited staleness, refresh, byte budget."""

from __future__ import annotations

import math

import pytest
import torch
from _models import build, build_hybrid
from _reference import VOCAB, padded_completions, stock_logprobs
from _trl_helpers import make_tiny_longstraw_trainer
from datasets import Dataset

from longstraw_trl import capture_prompt, extend_state, replay_logprobs
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.state_cache import PromptStateCache

MODELS = {"qwen3": lambda: build("qwen3"), "qwen3_5": lambda: build_hybrid("qwen3_5")}


class Counting:
    """capture / extend through the engine, counting the prompt tokens each prefills."""

    def __init__(self, model):
        self.model, self.captured, self.extended = model, [], []

    def capture(self, ids):
        self.captured.append(ids.numel())
        return capture_prompt(self.model, ids, chunk_size=8, page_size=4)

    def extend(self, state, more):
        self.extended.append(more.numel())
        return extend_state(state, self.model, more)


def _cache(model, policy="reuse", interval=1, max_bytes=None, prompt_prefix_sharing=True):
    calls = Counting(model)
    policy = RefreshPolicy(policy, interval)
    return PromptStateCache(
        calls.capture, calls.extend, policy, max_bytes, prompt_prefix_sharing=prompt_prefix_sharing
    ), calls


def _history(n, seed=0):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(MODELS))
def test_grown_history_costs_only_its_new_tokens(family):
    model = MODELS[family]()
    cache, calls = _cache(model)
    history = _history(70)
    first = cache.get(history[:41], step=0)
    assert first.action == "capture" and calls.captured == [41]
    assert cache.pop_stats() == {"tokens_captured": 41, "tokens_reused": 0}
    grown = cache.get(history, step=0)  # 29 more tokens: a turn appended to the history
    assert grown.action == "extend" and calls.captured == [41] and calls.extended == [29]
    assert cache.pop_stats() == {"tokens_captured": 29, "tokens_reused": 41}
    comps, mask = padded_completions([6, 4], torch.Generator().manual_seed(1))
    got = replay_logprobs(grown.entry.state, model, comps, mask)
    fresh = replay_logprobs(capture_prompt(model, history, chunk_size=8, page_size=4), model, comps, mask)
    stock = stock_logprobs(model, history, comps)
    assert torch.allclose(got * mask, fresh * mask, atol=1e-4, rtol=0)
    assert torch.allclose(got * mask, stock * mask, atol=1e-4, rtol=0)
    # the prefix's state is unchanged by the fork that extended it
    short = replay_logprobs(first.entry.state, model, comps, mask)
    assert torch.allclose(short * mask, stock_logprobs(model, history[:41], comps) * mask, atol=1e-4, rtol=0)


def test_longest_usable_prefix_is_extended():
    """Exact prefixes only (``prompt_prefix_sharing=False``); tests/test_prefix_tree.py covers branching."""
    model = build("qwen3")
    cache, calls = _cache(model, prompt_prefix_sharing=False)
    history = _history(60)
    for n in (10, 30, 20):
        cache.get(history[:n], step=0)
    assert calls.captured == [10] and calls.extended == [20, 10]  # 30 and 20 both extend the 10
    cache.get(history[:25].clone(), step=0)
    assert calls.extended[-1] == 5  # from the 20-token prompt, the longest prefix of the 25
    other = history.clone()
    other[5] = (other[5] + 1) % VOCAB
    assert cache.get(other[:40], step=0).action == "capture"  # no cached prompt is a prefix of it


def test_longest_common_prefix_is_extended():
    model = build("qwen3")
    cache, calls = _cache(model)
    history = _history(60)
    for n in (10, 30, 20):
        cache.get(history[:n], step=0)
    assert calls.captured == [10] and calls.extended == [
        20,
        1,
    ]  # the 20 re-runs only its last token on the 30's
    other = history.clone()
    other[5] = (other[5] + 1) % VOCAB
    assert cache.get(other[:40], step=0).action == "extend" and calls.extended[-1] == 35  # branches after 5


def test_extended_state_inherits_its_prefix_staleness():
    model = build("qwen3")
    cache, calls = _cache(model, policy="reuse", interval=2)
    history = _history(50)
    cache.get(history[:30], step=0)
    grown = cache.get(history, step=1)  # the prefix is one step old, within the interval: extended
    assert grown.action == "extend" and grown.entry.captured_at == 0
    assert cache.get(history, step=2).action == "reuse"  # age 2 <= interval
    again = cache.get(history, step=3)  # age 3: stale past the interval, and so is its prefix
    assert again.action == "recapture" and again.age == 3
    assert calls.captured == [30, 50] and again.entry.captured_at == 3


def test_recapture_extends_a_fresh_prefix_not_a_stale_one():
    model = build("qwen3")
    cache, calls = _cache(model, policy="recapture")
    history = _history(50)
    cache.get(history[:30], step=0)
    cache.get(history, step=0)
    assert calls.captured == [30] and calls.extended == [20]
    # step 1: the prefix is re-captured first (stale under "recapture"), then the grown prompt extends it
    assert cache.get(history[:30], step=1).action == "recapture"
    rebuilt = cache.get(history, step=1)
    assert rebuilt.action == "recapture" and calls.captured == [30, 30] and calls.extended == [20, 20]
    assert rebuilt.entry.captured_at == 1
    # step 2: nothing fresh to extend: the grown prompt is captured whole
    assert cache.get(history, step=2).action == "recapture" and calls.captured[-1] == 50


def test_byte_budget_evicts_least_recently_used_and_counts_shared_pages_once():
    model = build("qwen3")
    cache, _ = _cache(model, max_bytes=None)
    history = _history(64)
    a = cache.get(history[:32], step=0).entry
    b = cache.get(history, step=0).entry
    alone = cache.nbytes([a.key]) + cache.nbytes([b.key])
    assert cache.nbytes() < alone  # b's fork shares a's K/V segments
    c = cache.get(_history(40, seed=5), step=0).entry
    cache.max_bytes = cache.nbytes([c.key]) + 1
    cache.get(history, step=0)  # b used last, then c is pinned
    cache.pin([c.key])
    cache.evict(step=0)
    assert set(cache.entries) == {c.key}  # a and b (least recent first) went until within the budget
    cache.pin([])
    cache.max_bytes = 0
    cache.evict(step=0)
    assert len(cache) == 0


def test_trainer_extends_a_history_within_one_batch():
    """Two rows whose prompts are one history before and after a turn: one capture, one extension."""
    short = "a b c d e f g h i j k l m n o p"
    rows = [short, short + " q r s t u v"]
    trainer = make_tiny_longstraw_trainer(
        train_dataset=Dataset.from_dict({"prompt": rows * 2}),
        per_device_train_batch_size=4,
        num_generations=2,
        gradient_accumulation_steps=1,
        max_steps=1,
        logging_steps=1,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "longstraw/refresh/extend" in h]
    tokenizer = trainer.processing_class
    n_short, n_long = (len(tokenizer(p)["input_ids"]) for p in rows)
    assert logs[0]["longstraw/refresh/capture"] == 1 and logs[0]["longstraw/refresh/extend"] == 1
    assert math.isclose(logs[0]["longstraw/tokens_captured"], n_long)  # n_short + (n_long - n_short)
    # the extension's prefix only: the loss's own lookups of the states this step built are not reuse
    assert logs[0]["longstraw/tokens_reused"] == n_short


def test_tokens_reused_counts_states_of_earlier_steps_once_a_step():
    """A brand-new prompt is captured, not reused, however often its step looks it up (generation, then the
    loss); a state reused from an earlier step counts its tokens once that step."""
    cache, calls = _cache(build("qwen3"), policy="reuse", interval=2)
    history = _history(30)
    assert cache.get(history, step=0).action == "capture"
    assert cache.get(history, step=0).action == "fresh"  # the loss's lookup, same step
    assert cache.pop_stats() == {"tokens_captured": 30, "tokens_reused": 0}
    assert [cache.get(history, step=1).action for _ in range(3)] == ["reuse"] * 3
    assert cache.pop_stats() == {"tokens_captured": 0, "tokens_reused": 30}
    assert cache.get(history, step=3).action == "recapture" and cache.get(history, step=3).action == "fresh"
    assert cache.pop_stats() == {"tokens_captured": 30, "tokens_reused": 0} and calls.captured == [30, 30]


def test_trainer_logs_no_reuse_for_a_new_prompt():
    """num_iterations=2 under "reuse": step 1 captures (nothing reused), step 2 replays on the step-old state."""
    trainer = make_tiny_longstraw_trainer(
        train_dataset=Dataset.from_dict({"prompt": ["a b c d e f g h"] * 4}),
        gradient_accumulation_steps=1,
        num_iterations=2,
        refresh_policy="reuse",
        refresh_interval=1,
        max_steps=2,
    )
    trainer.train()
    first, second = (h for h in trainer.state.log_history if "longstraw/tokens_reused" in h)
    n = len(trainer.processing_class("a b c d e f g h")["input_ids"])
    assert (first["longstraw/tokens_captured"], first["longstraw/tokens_reused"]) == (n, 0)
    assert (second["longstraw/tokens_captured"], second["longstraw/tokens_reused"]) == (0, n)
