"""Agent training: `tools`, `environment_factory` and `rollout_func` with `LongStrawGRPOTrainer` against stock TRL.

Real Qwen3.6 tokenizer and chat template (`longstraw_trl.qwen_tokenizer`), tiny random models whose vocabulary is the
tokenizer's; both trainers draw the same tokens through a scripted policy (`tests/_agent_helpers.py`), so completions,
`tool_mask`, rewards, old log-probs and the loss come from each trainer's own code. Gradients are compared with the
response-only reference (stock HF model, prompt prefilled under no_grad).
"""

from __future__ import annotations

import math

import pytest
import torch
from _agent_helpers import (
    ASYNC_SCRIPTS,
    MESSAGES,
    SCRIPTS,
    Script,
    add,
    divide,
    lookup,
    make_pair,
    script_longstraw,
    script_stock,
)
from _trl_helpers import patch_response_only_logps
from test_trainer_parity import assert_grads_close

ROWS = [{"prompt": MESSAGES}] * 4


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


class Counts:
    """Wraps the prompt-state cache's capture / extend: the prompt tokens each prefills."""

    def __init__(self, trainer):
        cache = trainer.prompt_cache
        self.captured, self.extended = [], []
        capture, extend = cache._capture, cache._extend

        def counted_capture(ids):
            self.captured.append(ids.numel())
            return capture(ids)

        def counted_extend(state, more):
            self.extended.append(more.numel())
            return extend(state, more)

        cache._capture, cache._extend = counted_capture, counted_extend


def _generate_both(stock, ours, scripts, **script_kwargs):
    stock_script, ours_script = Script(stock.processing_class, scripts), Script(ours.processing_class, scripts)
    script_stock(stock, stock_script)
    script_longstraw(ours, ours_script, **script_kwargs)
    counts = Counts(ours)
    for trainer in (stock, ours):
        trainer._metrics["train"].clear()
    ref = stock._generate_and_score_completions([dict(r) for r in ROWS])
    out = ours._generate_and_score_completions([dict(r) for r in ROWS])
    return ref, out, counts, (stock_script, ours_script)


def _assert_same_rollouts(ref, out, stock, ours):
    for name in ("completion_ids", "completion_mask", "tool_mask"):
        assert torch.equal(out[name], ref[name]), name
    torch.testing.assert_close(out["advantages"], ref["advantages"], atol=1e-6, rtol=0)
    for name in ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length"):
        assert ours._metrics["train"][name] == stock._metrics["train"][name], name
    assert list(ours._logs["completion"])[-4:] == list(stock._logs["completion"])[-4:]


def _assert_loss_parity(ref, out, stock, ours):
    mask = ref["completion_mask"]
    if "old_per_token_logps" in ref:
        diff = (out["old_per_token_logps"] - ref["old_per_token_logps"]) * mask
        assert diff.abs().max() <= 1e-4
    stock.model.zero_grad()
    patch_response_only_logps(stock, ref["prompt_ids"][0])
    ref_loss = stock._compute_loss(stock.model, ref)
    ref_loss.backward()
    ours.model.zero_grad()
    loss = ours._streamed_loss(ours.model, out, backward=True)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=0)
    assert_grads_close(_grads(ours.model), _grads(stock.model))
    assert ours._metrics["train"]["entropy"][-1] == pytest.approx(stock._metrics["train"]["entropy"][-1], rel=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_tools_match_stock_trl(family):
    """A tool that works, one that raises, none, and max_tool_calling_iterations hit: the same rollouts, tool_mask,
    rewards and loss as stock GRPOTrainer; the group's prompt is captured once and every tool turn only extends."""
    stock, ours = make_pair(family, tools=[add, divide], max_tool_calling_iterations=2, num_iterations=2)
    ref, out, counts, (stock_script, ours_script) = _generate_both(stock, ours, SCRIPTS)
    assert sorted(ours_script.calls) == sorted(stock_script.calls)
    # rollouts 0, 1: one tool turn; 2: none; 3: two (the third call is left unexecuted)
    assert sorted(ours_script.calls) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1), (3, 2)]
    _assert_same_rollouts(ref, out, stock, ours)
    tool_mask = out["tool_mask"]
    assert (tool_mask == 0).any(dim=1).tolist() == [True, True, False, True]
    failed = [m for m in list(stock._logs["completion"])[-3] if m["role"] == "tool"]
    assert failed and "error" in str(failed[0]["content"]) and "division by zero" in str(failed[0]["content"])
    last = list(stock._logs["completion"])[-1]
    assert [m["role"] for m in last].count("tool") == 2 and "tool_calls" in last[-1]

    prompt_len = out["longstraw_prompts"][0][1].numel()
    assert counts.captured == [prompt_len]  # once per group, never again
    # each tool turn extends its rollout's state (the prompt's, then its previous turn's) by the completion so far
    # and the tool suffix: per rollout, its whole completion but the last turn
    expected = [int(out["completion_mask"][i].sum()) - len(last_turn_ids(ours_script, ours, i)) for i in (0, 1, 3)]
    assert len(counts.extended) == 4 and sum(counts.extended) == sum(expected)
    stats = ours.prompt_cache.pop_stats()
    assert stats["tokens_captured"] == prompt_len + sum(expected)
    assert len(ours.prompt_cache) == 1  # the tool turns' states are dropped after the loop
    assert sum(ours._metrics["train"]["longstraw/extend_tokens"]) == sum(counts.extended)

    _assert_loss_parity(ref, out, stock, ours)


def last_turn_ids(script, trainer, i):
    """Token ids of rollout i's last scripted turn (what follows its last tool suffix)."""
    from _agent_helpers import turn

    r, k = max((c for c in script.calls if c[0] == i), key=lambda c: c[1])
    return trainer.processing_class(turn(r, k, script.scripts[r][k]), add_special_tokens=False)["input_ids"]
