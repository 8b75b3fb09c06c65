"""The streamed loss's parts, each on its own: the rows' replay plan and the gradient sync on plain lists, a response's
term, and on a small model the batched replay against reverse block replay and the high-entropy mask's pass
(longstraw_trl.loss_rows, loss_sync, loss_terms, loss_replays, loss_entropy_mask)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _reference import param_grads
from test_streamed_loss import Host, RecordingCollectives, _inputs, _setup

from longstraw_trl.errors import NonFiniteLossError
from longstraw_trl.loss import GRPOLossSpec, batch_loss_context, high_entropy_mask
from longstraw_trl.loss_entropy_mask import replay_entropies, top_entropy_mask
from longstraw_trl.loss_prompts import GroupPrompts
from longstraw_trl.loss_replays import BatchedReplay, BlockReplay
from longstraw_trl.loss_rows import MicroBatchRows, plan_group_replays
from longstraw_trl.loss_sync import GradientSync, plan_sync
from longstraw_trl.loss_terms import LossTally, ResponseTerms
from longstraw_trl.streamed_loss import LossScaling, SingleProcess


# ----------------------------------------------------------------------------------------------------------------------
# plain lists
# ----------------------------------------------------------------------------------------------------------------------
def test_micro_batch_rows_group_whole_groups_in_order_and_mask_tools():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    tool_mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
    inputs = {
        "completion_ids": torch.zeros(4, 3, dtype=torch.long),
        "completion_mask": mask,
        "tool_mask": tool_mask,
        "longstraw_prompts": [("a", None), ("b", None)],
    }
    rows = MicroBatchRows.of(inputs)
    assert rows.row_group == [0, 0, 1, 1] and rows.rows_of == [[0, 1], [2, 3]] and rows.num_groups == 2
    assert torch.equal(rows.loss_mask, mask * tool_mask) and rows.lengths == (1, 1, 0, 2)


def test_group_replays_skip_rows_without_loss_tokens_and_lengthen_the_sync_row():
    lengths = [3, 0, 5, 0, 1]
    plan = plan_group_replays(
        [0, 1, 2, 3, 4], lengths, None, 5, budget=10, one_at_a_time=False, replay_empty=False
    )
    assert plan.skipped == [1, 3] and plan.batches == [[0, 2], [4]] and plan.lengths == {0: 3, 2: 5, 4: 1}
    # the synchronising row replays even without a loss token, at least 2 positions (DDP expects every layer)
    synced = plan_group_replays([0, 1, 4], lengths, 1, 5, budget=0, one_at_a_time=False, replay_empty=False)
    assert synced.skipped == [] and synced.batches == [[0], [1], [4]] and synced.lengths[1] == 2
    assert plan_group_replays([4, 1], lengths, 4, 1, 10, False, False).lengths == {
        4: 1
    }  # a 1-wide micro-batch
    # the router loss replays every row (a prompt is routed even without completion tokens), one at a time
    routed = plan_group_replays([0, 1], lengths, None, 5, budget=100, one_at_a_time=True, replay_empty=True)
    assert routed.skipped == [] and routed.batches == [[0], [1]]


def test_gradient_sync_contexts_follow_the_plan():
    row_group, lengths = [0, 0, 1, 1], [3, 1, 9, 0]
    collectives, model = RecordingCollectives(num_processes=2), torch.nn.Linear(1, 1)

    def skipping(context) -> bool:
        with context:
            return collectives.skipping

    sync = GradientSync(plan_sync(row_group, lengths, 2, ddp=True, full=False), collectives, model)
    assert skipping(sync.around_batch([0, 1])) and not skipping(sync.around_batch([2]))
    assert sync.inside_response(0) is None and skipping(sync.inside_response(2)())
    assert skipping(sync.inside_prompt_backward()())
    full = GradientSync(plan_sync(row_group, lengths, 2, ddp=True, full=True), collectives, model)
    assert skipping(full.around_batch([2])) and full.inside_response(2) is None
    assert full.prompt_backward_syncs(1) and not full.prompt_backward_syncs(0)
    single = GradientSync(plan_sync(row_group, lengths, 2, ddp=False, full=False), collectives, model)
    assert not skipping(single.around_batch([0])) and single.inside_prompt_backward() is None


def _terms(advantages: torch.Tensor, lengths: list[int]) -> ResponseTerms:
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    spec = GRPOLossSpec.from_args(SimpleNamespace(loss_type="dapo", beta=0.0))
    ctx = batch_loss_context(spec, mask, num_items_in_batch=mask.sum())
    inputs = {"advantages": advantages, "completion_ids": mask.clone()}
    return ResponseTerms(spec, ctx, inputs, LossScaling(global_step=6, micro_step=2))


def test_response_terms_zero_an_empty_row_and_stop_on_a_non_finite_one():
    terms = _terms(torch.tensor([1.0, float("nan"), 2.0]), [2, 3, 0])
    entry = SimpleNamespace(key="k", prompt_ids=torch.zeros(4))
    logps = torch.full((3,), -0.5, requires_grad=True)
    term, _ = terms.term(2, 0, entry, 3, logps, torch.zeros(3))
    assert term.item() == 0.0 and term.requires_grad
    skipped, metrics = terms.without_replay(2)
    assert skipped.item() == 0.0 and metrics.sums["entropy"].item() == 0.0
    with pytest.raises(
        NonFiniteLossError, match=r"global step 7 \(micro-step 2\).*response 1.*the advantage"
    ):
        terms.term(1, 0, entry, 3, logps, torch.zeros(3))


# ----------------------------------------------------------------------------------------------------------------------
# a model
# ----------------------------------------------------------------------------------------------------------------------
def _replay_all(kind: str, model, loss, inputs) -> tuple[LossTally, dict]:
    """Every row of ``inputs`` replayed by the part ``kind`` and back-propagated: the tally and the weight grads."""
    model.zero_grad()
    rows = MicroBatchRows.of(inputs)
    prompts = GroupPrompts(loss.prompt_states, inputs, rows, loss.options.temperature)
    ctx = batch_loss_context(loss.spec, rows.loss_mask, num_items_in_batch=inputs["num_items_in_batch"])
    sync = GradientSync(
        plan_sync(rows.row_group, ctx.lengths, rows.num_groups, False, False), SingleProcess(), model
    )
    terms, tally = ResponseTerms(loss.spec, ctx, inputs, LossScaling()), LossTally(torch.device("cpu"))
    if kind == "batched":
        replay = BatchedReplay(loss.policy_replay, inputs, terms, tally, sync, SingleProcess.backward, False)
        batches = rows.rows_of
    else:
        replay = BlockReplay(2, 1.0, None, loss.segment_context, inputs, terms, tally, sync, False)
        batches = [[i] for group in rows.rows_of for i in group]
    for batch in batches:
        g = rows.row_group[batch[0]]
        replay.run(model, prompts.entry(g), g, batch, [ctx.lengths[i] for i in batch], None)
    return tally, param_grads(model)


def test_batched_replay_terms_equal_block_replay_terms_for_the_same_rows():
    model, _, loss = _setup()
    inputs = _inputs(lengths=(4, 2, 5, 3))
    batched, batched_grads = _replay_all("batched", model, loss, inputs)
    blocks, block_grads = _replay_all("blocks", model, loss, inputs)
    assert (
        batched.replay_tokens == blocks.replay_tokens == 14
        and len(batched.metrics) == len(blocks.metrics) == 4
    )
    torch.testing.assert_close(batched.total, blocks.total, atol=1e-6, rtol=0)
    for ours, theirs in zip(batched.metrics, blocks.metrics, strict=True):
        torch.testing.assert_close(ours.policy_loss, theirs.policy_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.sums["entropy"], theirs.sums["entropy"], atol=1e-5, rtol=1e-5)
    for name in batched_grads:
        torch.testing.assert_close(batched_grads[name], block_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_mask_pass_replays_each_group_with_loss_tokens_once():
    model, host, loss = _setup()
    inputs = _inputs(lengths=(4, 2, 0, 0))  # group 1: no loss token, never replayed
    rows = MicroBatchRows.of(inputs)
    prompts = GroupPrompts(loss.prompt_states, inputs, rows, 1.0)
    seen = []

    def trl_mask(entropies, mask, threshold):
        seen.append(threshold)
        return high_entropy_mask(entropies, mask, 1 - threshold)

    mask = top_entropy_mask(prompts, host, inputs, rows, 1.0, 0.25, trl_mask)
    assert [g for g, _ in prompts.acquired()] == [0] and seen == [0.75]
    assert len(host.metrics["longstraw/entropy_pass_seconds"]) == 1
    entropies = replay_entropies(prompts, Host(), inputs, rows, 1.0)
    assert torch.equal(mask, high_entropy_mask(entropies, rows.loss_mask, 0.25))
    assert entropies[2:].abs().sum() == 0 and (entropies[:2, :4] > 0).all()
    with torch.no_grad():  # each row alone on the same state: the batched pass's entropies, to float rounding
        _, alone = loss.policy_replay(
            model, prompts.entry(0).state, inputs["completion_ids"][:1, :4], rows.loss_mask[:1, :4]
        )
    torch.testing.assert_close(entropies[0, :4], alone[0], atol=1e-5, rtol=1e-5)
