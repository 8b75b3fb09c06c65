"""Prefix sharing: prompts that share any common prefix are captured once up to it, then extended.

Within a generation batch the prompts' trie is known before capture (each trunk captured once, forked at its branch
points); across steps a later prompt branches off any cached state it shares a prefix with (K/V pages shared up to the
branch point; GDN and window states from the boundary kept at or before it, so at most one chunk is prefilled again).
Every state is checked against the stock HF model's full forward and a fresh capture of the whole prompt.
"""

from __future__ import annotations

import math

import pytest
import torch
from _models import build, build_glm_dsa, build_hybrid, build_window
from _reference import VOCAB, assert_grads_close, padded_completions, param_grads, stock_logprobs
from _trl_helpers import make_tiny_longstraw_trainer
from datasets import Dataset
from test_full_gradient import stock_full_grads
from test_streamed_loss import Host

from longstraw_trl import capture_prompt, extend_state, replay_logprobs
from longstraw_trl.engine import StateGrads, prompt_backward
from longstraw_trl.planner import plan_memory, shared_prefix_boundary_bytes
from longstraw_trl.prompt_state_manager import CaptureOptions, PromptStateManager
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.state_cache import branch_prefixes, prompt_key

CHUNK = 8
MODELS = {"qwen3": lambda: build("qwen3"), "qwen3_5": lambda: build_hybrid("qwen3_5")}


def _ids(n, seed):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _decision_points(shared=37, seed=0):
    """Three prompts of one history (``shared`` tokens) that are not prefixes of each other: two decision points
    whose last turn renders differently, and a sibling branching inside the first one's branch."""
    history, a, b = _ids(shared, seed), _ids(9, seed + 1), _ids(6, seed + 2)
    b[0] = (a[0] + 1) % VOCAB  # the branches differ from their first token
    sibling = torch.cat([a[:4], _ids(5, seed + 3)])
    sibling[4] = (a[4] + 1) % VOCAB
    return [torch.cat([history, a]), torch.cat([history, b]), torch.cat([history, sibling])]


def _states(model, share=True, chunk=CHUNK):
    host = Host()
    options = CaptureOptions(capture_chunk_size=chunk, page_size=4, prompt_prefix_sharing=share)
    return PromptStateManager(host, model, options, RefreshPolicy("reuse", 2)), host


def _acquire(states, prompts):
    with states.generation_batch():
        keys, entries = states.acquire_groups(prompts, num_generations=1)
    return [entries[k] for k in keys]


def _assert_matches_stock(model, entry, seed=0):
    comps, mask = padded_completions([5, 3], torch.Generator().manual_seed(seed))
    got = replay_logprobs(entry.state, model, comps, mask)
    fresh = replay_logprobs(
        capture_prompt(model, entry.prompt_ids, chunk_size=CHUNK, page_size=4), model, comps, mask
    )
    stock = stock_logprobs(model, entry.prompt_ids, comps)
    torch.testing.assert_close(got * mask, stock * mask, atol=1e-4, rtol=0)
    torch.testing.assert_close(got * mask, fresh * mask, atol=1e-4, rtol=0)


def test_branch_prefixes_are_the_trie_branch_points():
    h = torch.arange(10, 30)  # no id of x or y inside it
    x, y = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])
    prompts = [torch.cat([h, x]), torch.cat([h, y]), torch.cat([h, x, x]), h[:10], torch.cat([h[:12], y])]
    trunks = branch_prefixes(prompts)
    # h[:12] (h + ... against h[:12] + y) and h + [1, 2] (x against y); h + x is a whole prefix of h + x + x, and h[:10]
    # of all: no trunk
    assert [t.numel() for t in trunks] == [12, 22]
    assert torch.equal(trunks[0], h[:12]) and torch.equal(trunks[1], torch.cat([h, x[:2]]))
    assert branch_prefixes([h, h[:5]]) == []  # a whole prefix is extended as it is: no trunk


@pytest.mark.parametrize("family", list(MODELS))
def test_batch_trie_captures_the_shared_prefix_once(family):
    model = MODELS[family]()
    prompts = _decision_points()
    states, host = _states(model)
    entries = _acquire(states, prompts)
    states.flush_counts("train", host.metrics)
    # the history once, the first branch's first 4 tokens once, then each branch's own tokens
    shared, fork = 37, 4
    branches = sum(p.numel() for p in prompts) - 3 * shared - 2 * fork + fork
    captured = host.metrics["longstraw/tokens_captured"][-1]
    assert captured == shared + branches
    # the trunks' and branches' prefixes: the history under the second trunk and the second branch, the first
    # trunk under the two others
    assert host.metrics["longstraw/tokens_reused"][-1] == 2 * shared + 2 * (shared + fork)
    assert host.metrics["longstraw/prefix_trunks"][-1] == 2
    for i, entry in enumerate(entries):
        _assert_matches_stock(model, entry, seed=i)
    # the states share the history's K/V pages: less than three whole captures
    whole, whole_host = _states(model, share=False)
    _acquire(whole, prompts)
    whole.flush_counts("train", whole_host.metrics)
    assert whole_host.metrics["longstraw/tokens_captured"][-1] == sum(p.numel() for p in prompts)
    assert states.nbytes() < whole.nbytes()


def test_a_common_prefix_shorter_than_a_chunk_is_not_shared():
    model = build("qwen3")
    prompts = _decision_points()
    states, host = _states(model, chunk=64)  # the history (37 tokens) is shorter than a chunk
    _acquire(states, prompts)
    states.flush_counts("train", host.metrics)
    assert host.metrics["longstraw/prefix_trunks"][-1] == 0
    assert host.metrics["longstraw/tokens_captured"][-1] == sum(p.numel() for p in prompts)


@pytest.mark.parametrize("family", list(MODELS))
def test_later_prompt_branches_inside_a_cached_state(family):
    model = MODELS[family]()
    first, second, _ = _decision_points(shared=37)
    states, host = _states(model)
    _acquire(states, [first])
    states.flush_counts("train", host.metrics)
    host.global_step = 1  # the next step: the first prompt's state is cached (reuse, interval 2)
    (entry,) = _acquire(states, [second])
    states.flush_counts("train", host.metrics)
    assert states.cache.entries[entry.key].parent == prompt_key(first)
    captured = host.metrics["longstraw/tokens_captured"][-1]
    branch = second.numel() - 37
    # K/V only: from the branch point itself; GDN: from the last chunk boundary before it
    assert captured == (branch if family == "qwen3" else second.numel() - 33)
    assert captured <= branch + CHUNK
    assert host.metrics["longstraw/tokens_reused"][-1] == second.numel() - captured
    _assert_matches_stock(model, entry)


FAMILIES = {
    "gemma3_text": lambda: build_window("gemma3_text"),  # sliding windows and full attention
    "mistral": lambda: build_window("mistral"),  # every layer a sliding window
    "glm_moe_dsa": lambda: build_glm_dsa(),  # MLA latent + DSA indexer keys (index_topk >= T: no tie to flip)
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_and_glm_states_branch_exactly(family):
    """A batch trie and a later branch inside a cached state: window states come from the kept chunk boundaries,
    MLA latent and indexer-key pages are shared up to the branch point."""
    model = FAMILIES[family]()
    first, second, sibling = _decision_points(shared=29)
    states, host = _states(model)
    entries = _acquire(states, [first, sibling])
    host.global_step = 1
    entries += _acquire(states, [second])
    states.flush_counts("train", host.metrics)
    assert host.metrics["longstraw/prefix_trunks"][-1] == 1
    window = family != "glm_moe_dsa"  # the branch at 29 goes back to the boundary at 24 (window states)
    branch_start = 25 if window else 29
    expected = first.numel() + (sibling.numel() - 33) + (second.numel() - branch_start)
    assert host.metrics["longstraw/tokens_captured"][-1] == expected
    for i, entry in enumerate(entries):
        _assert_matches_stock(model, entry, seed=i)


def _text_reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) for c in completions]


SIBLING_HISTORY = "a b c d e f g h i j k l m n o p q r s t"
#: two decision points of one history whose last turns differ: neither prompt is a prefix of the other
SIBLING_ROWS = [SIBLING_HISTORY + " u v w", SIBLING_HISTORY + " x y"]


def sibling_trainer(family: str, **options):
    """A tiny trainer for one step (8-token capture chunks) on :data:`SIBLING_ROWS`, G = 2; ``options`` go to its
    config. qwen3: the tiny trainer's own model; qwen3_5: the hybrid (its vocabulary covers the toy tokenizer's)."""
    return make_tiny_longstraw_trainer(
        train_dataset=Dataset.from_dict({"prompt": SIBLING_ROWS * 2}),
        reward_funcs=_text_reward,
        per_device_train_batch_size=4,
        num_generations=2,
        gradient_accumulation_steps=1,
        max_steps=1,
        logging_steps=1,
        capture_chunk_size=8,
        seed=3,
        **({"model": MODELS["qwen3_5"]()} if family == "qwen3_5" else {}),
        **options,
    )


def sibling_log_and_ids(trainer) -> tuple[dict, list[torch.Tensor]]:
    """The logged step of a :func:`sibling_trainer` after ``train()``, and the token ids of its two prompts."""
    (log,) = (h for h in trainer.state.log_history if "longstraw/tokens_captured" in h)
    return log, [torch.tensor(trainer.processing_class(p)["input_ids"]) for p in SIBLING_ROWS]


def _train_one_step(family: str, share: bool, **options):
    """One `trainer.train()` step (SGD, so the update is the gradient) on the sibling prompts."""
    trainer = sibling_trainer(
        family,
        optim="sgd",
        learning_rate=0.5,
        activation_checkpointing=True,  # TRL's default
        prompt_prefix_sharing=share,
        **options,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    return (update, *sibling_log_and_ids(trainer))


# the hybrid's full mode (~13 s) runs with LONGSTRAW_SLOW=1; its branch's full gradient is also checked against stock in
# test_full_gradient_of_a_branch_reaches_the_shared_prefix
@pytest.mark.parametrize(
    ("family", "gradient_mode"),
    [
        ("qwen3", "response_only"),
        ("qwen3", "full"),
        ("qwen3_5", "response_only"),
        pytest.param("qwen3_5", "full", marks=pytest.mark.slow),
    ],
)
def test_train_step_with_a_shared_trunk_equals_capturing_each_prompt_whole(family, gradient_mode):
    """The full gradient's prompt backward of each branch recomputes the shared trunk's chunks of its own state (its
    token ids and boundaries are the trunk's, then its own), so it reaches the trunk as a whole capture's does."""
    shared_update, shared_log, (a, b) = _train_one_step(family, True, gradient_mode=gradient_mode)
    whole_update, whole_log, _ = _train_one_step(family, False, gradient_mode=gradient_mode)
    trunk = next(i for i in range(min(a.numel(), b.numel())) if a[i] != b[i])
    assert trunk > 16 and shared_log["longstraw/prefix_trunks"] == 1
    assert shared_log["longstraw/tokens_captured"] == a.numel() + b.numel() - trunk
    assert shared_log["longstraw/tokens_reused"] == 2 * trunk
    assert whole_log["longstraw/tokens_captured"] == a.numel() + b.numel()
    assert math.isclose(shared_log["loss"], whole_log["loss"], rel_tol=1e-5, abs_tol=1e-6)
    norm = torch.sqrt(sum((u.double() ** 2).sum() for u in whole_update.values()))
    diff = torch.sqrt(sum(((shared_update[n] - u).double() ** 2).sum() for n, u in whole_update.items()))
    assert norm > 1e-3 and diff <= 1e-4 * norm, (float(diff), float(norm))


def test_kept_boundary_states_count_once_in_the_byte_budget():
    model = build_hybrid("qwen3_5")
    first, second, _ = _decision_points()
    states, host = _states(model)
    _acquire(states, [first])
    host.global_step = 1
    _acquire(
        states, [second]
    )  # branches at the boundary at 32: shares the first's K/V and boundary states there
    cache = states.cache
    a, b = (cache.entries[prompt_key(p)] for p in (first, second))
    kept = [layer for at in a.state.boundaries.values() for layer in at.values()]
    assert kept and set(b.state.boundaries) >= {8, 16, 24, 32}
    boundary_bytes = cache.nbytes([a.key])
    a_boundaries, a.state.boundaries = a.state.boundaries, None
    assert boundary_bytes > cache.nbytes([a.key])  # the kept GDN states are in the budget
    a.state.boundaries = a_boundaries
    both = cache.nbytes([a.key, b.key])
    assert both < cache.nbytes([a.key]) + cache.nbytes([b.key])  # pages and boundaries shared: counted once
    # the planner's formula (`longstraw plan --prefix-sharing`): the GDN states at the boundaries 8, 16, 24, 32, 40
    planned = shared_prefix_boundary_bytes(model.config, first.numel(), dtype_bytes=4, chunk_size=CHUNK)
    assert planned == sum(layer.nbytes() for layer in kept) > 0
    plan = plan_memory(
        model.config, first.numel(), capture_chunk_size=CHUNK, dtype_bytes=4, prompt_prefix_sharing=True
    )
    assert plan.kept_boundaries == planned
    # beyond the pinned branch, the first prompt costs only what the branch does not share
    cache.pin([b.key])
    cache.max_bytes = both - cache.nbytes([b.key])
    cache.evict(step=1)
    assert a.key in cache.entries
    cache.max_bytes -= 1
    cache.evict(step=1)
    assert a.key not in cache.entries and b.key in cache.entries


@pytest.mark.parametrize("family", list(MODELS))
def test_full_gradient_of_a_branch_reaches_the_shared_prefix(family):
    """A state branched off another inside it (token ids and boundaries cut at the branch point, then its own):
    its prompt backward recomputes the shared chunks, so the full gradient equals the stock model's."""
    model = MODELS[family]()
    first, second, _ = _decision_points()
    source = capture_prompt(model, first, chunk_size=CHUNK, page_size=4, keep_boundaries=True)
    tokens = source.branch_point(37 - 1)
    assert tokens == (36 if family == "qwen3" else 32)
    branch = extend_state(source.prefix_state(tokens, second[tokens]), model, second[tokens + 1 :])
    gen = torch.Generator().manual_seed(5)
    comps, weights = torch.randint(0, VOCAB, (2, 6), generator=gen), torch.randn(2, 6, generator=gen)
    model.zero_grad()
    grads = StateGrads(branch)
    for i in range(comps.shape[0]):
        (
            replay_logprobs(branch, model, comps[i : i + 1], grad=True, grads=grads)[0] * weights[i]
        ).sum().backward()
    prompt_backward(branch, model, grads)
    got = param_grads(model)
    assert_grads_close(got, stock_full_grads(model, second, comps, weights))
