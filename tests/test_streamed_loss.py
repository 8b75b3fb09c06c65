"""The streamed loss on its own: no TRL trainer, a plain host and a small model (longstraw_trl.streamed_loss).

References: the replay batching and the sync plan on plain lists; the loss and its gradient against the stock HF
model (the response-only reference of tests/_reference.py, and a full-sequence forward for gradient_mode='full'),
for TRL's default loss (dapo: ``-sum(A_i * logp_it) / num_items_in_batch`` at ratio 1, the first iteration)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from _models import build
from _reference import param_grads, response_only_reference

import longstraw_trl.streamed_loss as streamed
from longstraw_trl.engine import checkpointing_off
from longstraw_trl.loss import GRPOLossSpec
from longstraw_trl.prompt_state_manager import CaptureOptions, PromptStateManager
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.state_cache import prompt_key
from longstraw_trl.streamed_loss import (
    LossOptions,
    LossScaling,
    SingleProcess,
    StreamedLoss,
    plan_sync,
    replay_batches,
    split_by_groups,
)

VOCAB = 97


# ----------------------------------------------------------------------------------------------------------------------
# plain lists
# ----------------------------------------------------------------------------------------------------------------------
def test_replay_batches_pack_rows_within_the_token_budget():
    lengths = {0: 3, 1: 5, 2: 2, 3: 8}
    # rows x longest <= 10: [0, 1] (2 x 5), [2] would make 3 x 5 = 15, so it starts a batch; [2, 3] is 2 x 8 = 16
    assert replay_batches([0, 1, 2, 3], lengths, budget=10, one_at_a_time=False) == [[0, 1], [2], [3]]
    assert replay_batches([0, 1, 2, 3], lengths, budget=16, one_at_a_time=False) == [[0, 1, 2], [3]]
    assert replay_batches([0, 1, 2, 3], lengths, budget=0, one_at_a_time=False) == [[0], [1], [2], [3]]
    assert replay_batches([0, 1], lengths, budget=100, one_at_a_time=True) == [[0], [1]]


def test_sync_plan_puts_the_longest_response_last():
    row_group = [0, 0, 1, 1, 2, 2]
    lengths = [3, 1, 9, 0, 4, 4]
    plan = plan_sync(row_group, lengths, 3, ddp=True, full=False)
    assert plan.sync_row == 2 and plan.group_order == [0, 2, 1]
    assert plan.rows_in_order([2, 3]) == [3, 2]
    assert plan.batch_skips_sync([3]) and not plan.batch_skips_sync([3, 2])
    # a process without any loss token still synchronises, through its first row
    assert plan_sync(row_group, [0] * 6, 3, ddp=True, full=False).sync_row == 0
    # one process: nothing to synchronise
    single = plan_sync(row_group, lengths, 3, ddp=False, full=False)
    assert single.sync_row is None and single.group_order == [0, 1, 2] and not single.batch_skips_sync([0])
    # the full gradient: every replay skips the sync, the last group's prompt backward synchronises
    full = plan_sync(row_group, lengths, 3, ddp=True, full=True)
    assert full.sync_row is None and all(full.batch_skips_sync([i]) for i in range(6))
    assert full.prompt_backward_syncs(1) and not full.prompt_backward_syncs(0)


def test_split_by_groups_keeps_each_rows_prompt():
    prompts = [("a", torch.tensor([1])), ("b", torch.tensor([2])), ("c", torch.tensor([3]))]
    batch = {"longstraw_prompts": prompts, "completion_ids": torch.arange(12)[:, None], "scalar": 7}
    chunks = split_by_groups(batch, 2, order=[2, 0, 1])
    assert [c["completion_ids"][:, 0].tolist() for c in chunks] == [[8, 9, 10, 11, 0, 1], [2, 3, 4, 5, 6, 7]]
    assert [k for k, _ in chunks[0]["longstraw_prompts"]] == ["c", "a"]
    assert chunks[0]["longstraw_row_group"].tolist() == [0, 0, 0, 0, 1, 1]
    assert chunks[1]["longstraw_row_group"].tolist() == [0, 0, 1, 1, 1, 1] and chunks[1]["scalar"] == 7


# ----------------------------------------------------------------------------------------------------------------------
# a model
# ----------------------------------------------------------------------------------------------------------------------
class Host:
    """The StepHost of a plain training loop."""

    phase, global_step, device = "train", 0, torch.device("cpu")

    def __init__(self):
        self.metrics = defaultdict(list)

    def phase_metrics(self):
        return self.metrics

    def graph_free(self, model, cast_adapters=False):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(checkpointing_off(model))
        return stack


class RecordingCollectives(SingleProcess):
    """One process pretending to be ``num_processes``: records whether each backward ran under ``no_sync``."""

    def __init__(self, num_processes: int):
        self.num_processes = num_processes
        self.skipping = False
        self.backwards: list[bool] = []  # True: under no_sync

    def backward(self, loss):
        self.backwards.append(self.skipping)
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self, model):
        before, self.skipping = self.skipping, True
        try:
            yield
        finally:
            self.skipping = before


def _setup(gradient_mode="response_only", collectives=None, **options):
    model = build("llama")
    model.train()
    host = Host()
    capture = CaptureOptions(capture_chunk_size=5, gradient_mode=gradient_mode, prompt_prefix_sharing=True)
    states = PromptStateManager(host, model, capture, RefreshPolicy("recapture"))
    spec = GRPOLossSpec.from_args(SimpleNamespace(loss_type="dapo", beta=0.0))
    loss = StreamedLoss(
        spec,
        LossOptions(gradient_mode=gradient_mode, **options),
        host,
        states,
        collectives or SingleProcess(),
    )
    return model, host, loss


def _inputs(lengths=(4, 2, 5, 3), prompt_len=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (prompt_len + g,), generator=gen) for g in range(2)]
    width = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return {
        "completion_ids": ids * mask,
        "completion_mask": mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0]),
        "num_items_in_batch": torch.tensor(float(sum(lengths))),
        "longstraw_prompts": [(prompt_key(p), p) for p in prompts],
        "longstraw_row_group": torch.tensor([0, 0, 1, 1]),
    }


def _reference(model, inputs, full: bool):
    """The stock model's gradient of ``-sum(A_i * logp_it) / N`` (response-only: the prompt's cache a constant)."""
    total = {}
    n = inputs["num_items_in_batch"]
    for i, g in enumerate(inputs["longstraw_row_group"].tolist()):
        prompt = inputs["longstraw_prompts"][g][1]
        length = int(inputs["completion_mask"][i].sum())
        completion = inputs["completion_ids"][i, :length]
        weights = torch.full((length,), -float(inputs["advantages"][i]) / float(n))
        if full:
            model.zero_grad()
            seq = torch.cat([prompt, completion])[None]
            logits = model(seq).logits.float()[0, prompt.numel() - 1 : -1]
            logp = torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0]
            (logp * weights).sum().backward()
            grads = param_grads(model)
        else:
            grads = response_only_reference(model, prompt, completion, weights)
        for name, grad in grads.items():
            total[name] = total.get(name, 0) + grad
    model.zero_grad()
    return total


def _assert_grads(ours, ref, atol=1e-5):
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("replay_batch_tokens", [0, 8192])
def test_loss_and_gradient_equal_the_stock_response_only_reference(replay_batch_tokens):
    model, host, loss = _setup(replay_batch_tokens=replay_batch_tokens)
    inputs = _inputs()
    ref = _reference(model, inputs, full=False)
    total, bonus = loss(model, inputs, backward=True, scaling=LossScaling())
    expected = -(inputs["advantages"] * inputs["completion_mask"].sum(1)).sum() / inputs["num_items_in_batch"]
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=0)
    assert bonus is None and not total.requires_grad
    _assert_grads(param_grads(model), ref)
    assert len(host.metrics["longstraw/capture_seconds"]) == 2  # each group's prompt captured once


def test_full_gradient_equals_the_stock_full_sequence_gradient():
    model, host, loss = _setup("full")
    inputs = _inputs()
    ref = _reference(model, inputs, full=True)
    loss(model, inputs, backward=True, scaling=LossScaling())
    _assert_grads(param_grads(model), ref)
    assert len(host.metrics["longstraw/prompt_backward_seconds"]) == 2  # one prompt backward per group


def test_reverse_block_replay_equals_the_whole_replay():
    model, _, loss = _setup(replay_block_size=2)
    inputs = _inputs()
    ref = _reference(model, inputs, full=False)
    loss(model, inputs, backward=True, scaling=LossScaling())
    _assert_grads(param_grads(model), ref)


@pytest.mark.parametrize("gradient_mode", ["response_only", "full"])
def test_ddp_order_one_synchronising_backward_and_last(gradient_mode, monkeypatch):
    """Under (pretend) DDP exactly one backward of the micro-batch runs outside ``no_sync``, and it is the last one:
    the longest response's (response-only), or the last group's prompt backward (full)."""
    collectives = RecordingCollectives(num_processes=2)
    model, _, loss = _setup(gradient_mode, collectives=collectives, replay_batch_tokens=0)
    inputs = _inputs(lengths=(4, 2, 5, 3))
    if gradient_mode == "full":
        # the prompt backward's synchronising segment is the first chunk of the last group's prompt: count it
        real = streamed.prompt_backward

        def recording(state, model, grads, no_sync=None, sync_last=False, **kwargs):
            collectives.backwards.append(not sync_last)
            return real(state, model, grads, no_sync=no_sync, sync_last=sync_last, **kwargs)

        monkeypatch.setattr(streamed, "prompt_backward", recording)
        loss(model, inputs, backward=True, scaling=LossScaling())
        assert collectives.backwards == [True] * 4 + [
            True,
            False,
        ]  # 4 replays, then the 2 groups' prompt backward
    else:
        loss(model, inputs, backward=True, scaling=LossScaling())
        # rows by group order: the longest (row 2, group 1) synchronises, so group 1 runs last and row 2 last in it
        assert collectives.backwards == [True, True, True, False]
