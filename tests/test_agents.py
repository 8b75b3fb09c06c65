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
    EOS,
    MESSAGES,
    SCRIPTS,
    Script,
    add,
    call,
    divide,
    lookup,
    make_pair,
    script_longstraw,
    script_stock,
    turn,
)
from _reference import param_grads
from _trl_helpers import patch_response_only_logps
from test_trainer_parity import assert_grads_close

from longstraw_trl import generate_from_state

ROWS = [{"prompt": MESSAGES}] * 4


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
    stock_script, ours_script = (
        Script(stock.processing_class, scripts),
        Script(ours.processing_class, scripts),
    )
    script_stock(stock, stock_script)
    script_longstraw(ours, ours_script, **script_kwargs)
    counts = Counts(ours)
    for trainer in (stock, ours):
        trainer._metrics["train"].clear()
    ref = stock._generate_and_score_completions([dict(r) for r in ROWS])
    out = ours._generate_and_score_completions([dict(r) for r in ROWS])
    return ref, out, counts, (stock_script, ours_script)


def _assert_same_rollouts(ref, out, stock, ours, groups: int = 1):
    for name in ("completion_ids", "completion_mask", "tool_mask"):
        assert torch.equal(out[name], ref[name]), name
    torch.testing.assert_close(out["advantages"], ref["advantages"], atol=1e-6, rtol=0)
    for name in ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length"):
        assert ours._metrics["train"][name] == stock._metrics["train"][name], name
    rows = 4 * groups
    assert list(ours._logs["completion"])[-rows:] == list(stock._logs["completion"])[-rows:]
    # one loss group per prompt (the tool turns are not groups), and the tool turns' states are gone from the cache
    assert len(out["longstraw_prompts"]) == groups and len(ours.prompt_cache) == groups


def _assert_loss_parity(ref, out, stock, ours):
    """Loss and gradients equal stock's: its response-only version (the prompt's K/V constants), or, with
    `gradient_mode="full"`, stock itself (every completion, tool tokens included, replayed on the group's prompt state,
    whose gradient the prompt backward carries into the prompt)."""
    mask = ref["completion_mask"]
    if "old_per_token_logps" in ref:
        diff = (out["old_per_token_logps"] - ref["old_per_token_logps"]) * mask
        assert diff.abs().max() <= 1e-4
    stock.model.zero_grad()
    if ours.args.gradient_mode != "full":
        patch_response_only_logps(stock, ref["prompt_ids"][0])
    ref_loss = stock._compute_loss(stock.model, ref)
    ref_loss.backward()
    ours.model.zero_grad()
    loss = ours.micro_batch_loss(ours.model, out, backward=True)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=0)
    assert_grads_close(param_grads(ours.model), param_grads(stock.model))
    assert ours._metrics["train"]["entropy"][-1] == pytest.approx(
        stock._metrics["train"]["entropy"][-1], rel=1e-4
    )


# qwen3_5 (25 s) is slow: its GDN extension in tool turns is also tested by test_tool_turns_sample_from_the_extended_state
@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow)])
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
    expected = [
        int(out["completion_mask"][i].sum()) - len(last_turn_ids(ours_script, ours, i)) for i in (0, 1, 3)
    ]
    assert len(counts.extended) == 4 and sum(counts.extended) == sum(expected)
    stats = ours.prompt_cache.pop_stats()
    assert stats["tokens_captured"] == prompt_len + sum(expected)
    assert len(ours.prompt_cache) == 1  # the tool turns' states are dropped after the loop
    assert sum(ours._metrics["train"]["longstraw/extend_tokens"]) == sum(counts.extended)

    _assert_loss_parity(ref, out, stock, ours)


def last_turn_ids(script, trainer, i):
    """Token ids of rollout i's last scripted turn (what follows its last tool suffix)."""
    r, k = max((c for c in script.calls if c[0] == i), key=lambda c: c[1])
    return trainer.processing_class(turn(r, k, script.scripts[r][k]), add_special_tokens=False)["input_ids"]


# full mode with tools: test_environment_factory_matches_stock_trl[full] in the default suite (time budget)
@pytest.mark.parametrize("gradient_mode", ["response_only", pytest.param("full", marks=pytest.mark.slow)])
def test_async_tool_matches_stock_trl(gradient_mode):
    """An async tool (run on TRL's event loop) next to a sync one, two calls in one turn; the loss and gradients
    equal stock's (its full-sequence gradient with gradient_mode='full': through the tool tokens into the prompt)."""
    stock, ours = make_pair("qwen3", tools=[lookup, add], ours_kwargs=dict(gradient_mode=gradient_mode))
    assert ours._has_async_funcs
    ref, out, counts, (stock_script, ours_script) = _generate_both(stock, ours, ASYNC_SCRIPTS)
    _assert_same_rollouts(ref, out, stock, ours)
    both = [m for m in list(stock._logs["completion"])[-1] if m["role"] == "tool"]
    assert [m["content"] for m in both] == ["42", "41"]  # TRL appends the sync results before the async ones
    assert counts.captured == [out["longstraw_prompts"][0][1].numel()] and len(counts.extended) == 3
    _assert_loss_parity(ref, out, stock, ours)
    assert bool(ours._metrics["train"]["longstraw/prompt_backward_seconds"]) == (gradient_mode == "full")


class Notebook:
    """An environment: `read` is its tool, `reset(**row)` gets the dataset row, `get_reward` scores the rollout."""

    resets: list[dict] = []

    def reset(self, **row) -> str:
        Notebook.resets.append(dict(row))
        self.pages, self.reads = {"x": row["secret"]}, 0
        return " (the notebook is open)"

    def read(self, key: str) -> str:
        """Read a page of the notebook.

        Args:
            key: The page.
        """
        self.reads += 1
        return self.pages.get(key, "blank")

    def get_reward(self) -> float:
        return float(self.reads)


ENV_SCRIPTS = {
    0: [call("read", key="x"), "found it"],
    1: [call("read", key="z"), "blank page"],
    2: ["no need"],
    3: [call("read", key="x"), call("read", key="x"), "twice"],
}


@pytest.mark.parametrize("gradient_mode", ["response_only", "full"])
def test_environment_factory_matches_stock_trl(gradient_mode):
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": [MESSAGES] * 4, "secret": ["41"] * 4})
    stock, ours = make_pair(
        "qwen3", environment_factory=Notebook, dataset=dataset, ours_kwargs=dict(gradient_mode=gradient_mode)
    )
    assert ours.reward_func_names[-1] == "Notebook"
    rows = [{"prompt": MESSAGES, "secret": "41"}] * 4
    stock_script, ours_script = (
        Script(stock.processing_class, ENV_SCRIPTS),
        Script(ours.processing_class, ENV_SCRIPTS),
    )
    script_stock(stock, stock_script)
    script_longstraw(ours, ours_script)
    counts = Counts(ours)
    Notebook.resets.clear()
    ref = stock._generate_and_score_completions([dict(r) for r in rows])
    out = ours._generate_and_score_completions([dict(r) for r in rows])
    assert (
        Notebook.resets == [{"prompt": MESSAGES, "secret": "41"}] * 8
    )  # one reset per rollout, with its row
    _assert_same_rollouts(ref, out, stock, ours)
    assert [e.reads for e in ours.environments] == [1, 1, 0, 2]
    assert (
        ours._metrics["train"]["rewards/Notebook/mean"]
        == stock._metrics["train"]["rewards/Notebook/mean"]
        == [1.0]
    )
    prompt = ours.processing_class.decode(out["longstraw_prompts"][0][1])
    assert "add 1 and 2 (the notebook is open)" in prompt and '"name": "read"' in prompt
    assert counts.captured == [out["longstraw_prompts"][0][1].numel()] and len(counts.extended) == 4
    tools = [m["content"] for m in list(stock._logs["completion"])[-4] if m["role"] == "tool"]
    assert tools == ["41"]
    _assert_loss_parity(ref, out, stock, ours)


@pytest.mark.parametrize("gradient_mode", ["response_only", "full"])
def test_rollout_func_matches_stock_trl(gradient_mode):
    """Completions made outside (with their sampling log-probs and an env_mask) are scored and trained by capture +
    replay; the log-probs are TRL's `sampling_per_token_logps` (here they decide the off-policy mask)."""
    texts = ["answer 3", "it is three", "3, because 1 + 2", "no idea"]

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        completion_ids, logprobs, env_mask = [], [], []
        for i in range(len(prompts)):
            ids = tok(turn(i % 4, 0, texts[i % 4]), add_special_tokens=False)["input_ids"]
            completion_ids.append(ids)
            logprobs.append([-1.0 - 0.5 * (i % 2) - 0.01 * j for j in range(len(ids))])
            env_mask.append([0 if 1 <= j < 3 else 1 for j in range(len(ids))])  # "environment" tokens
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "env_mask": env_mask,
            "hint": [t[0] for t in texts] * (len(prompts) // 4),
        }

    def reward(completions, hint, **kwargs):
        return [len(c[0]["content"]) / 10 + (h == "3") for c, h in zip(completions, hint, strict=True)]

    stock, ours = make_pair(
        "qwen3",
        rollout_func=rollout,
        reward_funcs=reward,
        off_policy_mask_threshold=0.5,
        loss_type="grpo",
        ours_kwargs=dict(gradient_mode=gradient_mode),
    )
    counts = Counts(ours)
    ref = stock._generate_and_score_completions([dict(r) for r in ROWS])
    out = ours._generate_and_score_completions([dict(r) for r in ROWS])
    assert counts.captured == [out["longstraw_prompts"][0][1].numel()] and counts.extended == []
    for name in ("completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps"):
        assert torch.equal(out[name], ref[name]), name
    assert (out["tool_mask"] == 0).sum() == 8
    torch.testing.assert_close(out["advantages"], ref["advantages"], atol=1e-6, rtol=0)
    assert (out["advantages"] < 0).any()
    _assert_loss_parity(ref, out, stock, ours)
    # the sampling log-probs matter: the off-policy mask drops the negative-advantage rows
    without = {k: v for k, v in out.items() if k != "sampling_per_token_logps"}
    ours.model.zero_grad()
    with_logps = ours.micro_batch_loss(ours.model, out, backward=False).item()
    assert not math.isclose(
        ours.micro_batch_loss(ours.model, without, backward=False).item(), with_logps, abs_tol=1e-4
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_tool_turns_sample_from_the_extended_state(family):
    """Real draws after the tool result: each equals sampling from a fresh capture of prompt + completion + tool
    suffix with the same seed (the extended state is the whole sequence's state)."""
    from longstraw_trl import capture_prompt

    # a model whose draws depend on the context, at a low temperature (a random model's near-uniform draws over
    # 248k tokens hardly depend on anything)
    stock, ours = make_pair(
        family,
        tools=[add, divide],
        max_tool_calling_iterations=1,
        max_completion_length=72,
        temperature=0.3,
        init_std=0.2,
    )
    del stock
    script_longstraw(ours, Script(ours.processing_class, SCRIPTS), real_after_first_turn=True)
    sampled_from = []
    real = ours.rollout.sample_group
    ours.rollout.sample_group = lambda state, g, *a, **k: sampled_from.append(state.num_tokens) or real(
        state, g, *a, **k
    )
    torch.manual_seed(7)
    out = ours._generate_and_score_completions([dict(r) for r in ROWS])
    prompt = out["longstraw_prompts"][0][1]
    torch.manual_seed(7)
    kwargs = ours.rollout.sampling.sampler_kwargs()
    max_new = ours.rollout.sampling.max_new_tokens
    for i in (0, 1, 3):  # the rollouts that called a tool, in TRL's order
        ids, tool = out["completion_ids"][i], out["tool_mask"][i]
        n = int(out["completion_mask"][i].sum())
        cut = int(torch.nonzero(tool[:n] == 0).max()) + 1  # end of the tool suffix
        with torch.no_grad():
            state = capture_prompt(ours.model, torch.cat([prompt, ids[:cut]]))
            fresh = generate_from_state(state, ours.model, 1, max_new, **kwargs)[0]
        assert n > cut and torch.equal(ids[cut:n], fresh[: n - cut]), i
        assert prompt.numel() + cut in sampled_from


def test_train_with_tools_logs_tool_and_token_metrics():
    """`train()` end to end with tool calls: TRL's tool metrics, and the prompt tokens prefilled = the group's prompt
    once + each tool turn's new tokens."""
    stock, ours = make_pair(
        "qwen3",
        tools=[add, divide],
        max_tool_calling_iterations=2,
        max_steps=1,
        gradient_accumulation_steps=1,
    )
    del stock
    script_longstraw(ours, Script(ours.processing_class, SCRIPTS))
    counts = Counts(ours)
    ours.train()
    (log,) = [h for h in ours.state.log_history if "loss" in h]
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.25  # 4 calls, 1 raised
    assert counts.captured == [counts.captured[0]] and len(counts.extended) == 4
    assert log["longstraw/tokens_captured"] == counts.captured[0] + sum(counts.extended)
    assert log["longstraw/refresh/extend"] == 4 and log["longstraw/refresh/capture"] == 1
    assert math.isfinite(log["loss"]) and log["grad_norm"] > 0


def test_rollout_func_rows_of_a_group_must_share_their_prompt():
    from longstraw_trl import LongStrawError

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        ids = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        ids[1] = ids[1] + [198]  # a different prompt inside the first group
        return {"prompt_ids": ids, "completion_ids": [[EOS]] * len(ids), "logprobs": None}

    stock, ours = make_pair("qwen3", rollout_func=rollout)
    del stock
    with pytest.raises(
        LongStrawError, match=r"rows 0\.\.3 should be one group.*rollout_func must return the rows"
    ):
        ours._generate_and_score_completions([dict(r) for r in ROWS])


class Counter:
    """Environment-owned data and reward: `reset()` gives the prompt, `get_reward` scores the rollout."""

    resets: list[dict] = []

    def reset(self, **row) -> str:
        Counter.resets.append(dict(row))
        self.count = 0
        return "Count."

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: Value to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class Echo:
    """A second environment of the same dataset, with its own tool and no reward of its own."""

    resets: list[dict] = []

    def reset(self, **row) -> str:
        Echo.resets.append(dict(row))
        return "Echo."

    def shout(self, text: str) -> str:
        """Shout a text.

        Args:
            text: The text.
        """
        return text.upper()


ENVIRONMENT_SCRIPTS = {
    # the other environment's tool fails (each rollout sees its own environment's tools only)
    "Count.": {
        0: [call("increment", step=1), "one"],
        1: ["none"],
        2: [call("increment", step=2), call("increment", step=1), "three"],
        3: [call("shout", text="hi"), "not here"],
    },
    "Echo.": {
        0: [call("shout", text="hi"), "HI"],
        1: ["quiet"],
        2: [call("increment", step=1), "no"],
        3: ["x"],
    },
}
ENVIRONMENT_ROWS = [{"environment": "counter"}] * 4 + [{"environment": "echo"}] * 4


class ByObservation:
    """A `Script` per environment, chosen by the observation its `reset()` put in the context."""

    def __init__(self, tokenizer, scripts: dict[str, dict[int, list[str]]]):
        self.tokenizer = tokenizer
        self.scripts = {marker: Script(tokenizer, s) for marker, s in scripts.items()}

    def __call__(self, context: list[int], row: int) -> list[int]:
        text = self.tokenizer.decode(context)
        return next(script for marker, script in self.scripts.items() if marker in text)(context, row)

    @property
    def calls(self) -> list:
        return [(marker, c) for marker, script in self.scripts.items() for c in script.calls]


def _environment_pair(**kwargs):
    from datasets import Dataset

    Counter.resets.clear()
    Echo.resets.clear()
    return make_pair(
        "qwen3",
        environment_factory={"counter": Counter, "echo": Echo},
        dataset=Dataset.from_dict({"environment": ["counter", "echo"] * 2}),
        per_device_train_batch_size=8,
        shuffle_dataset=False,
        ours_kwargs=dict(gradient_mode="full"),
        **kwargs,
    )


@pytest.mark.slow  # 80 s in a clean-clone make test; the seam and the refusal stay in the default suite
def test_environment_owned_data_of_two_environments_matches_stock_trl():
    """TRL 1.16's environment-owned data: rows name their environment (no 'prompt' column), each rollout's `reset()`
    gives its prompt, each group sees only its environment's tools, and one environment owns its reward. The same
    rollouts, rewards and loss as stock (gradient_mode='full', so stock's full-sequence gradient is the reference);
    each group's G rollouts are sampled from its one prompt state."""
    stock, ours = _environment_pair()
    assert ours.reward_func_names == stock.reward_func_names == ["tool_reward", "Counter"]
    stock_script = ByObservation(stock.processing_class, ENVIRONMENT_SCRIPTS)
    ours_script = ByObservation(ours.processing_class, ENVIRONMENT_SCRIPTS)
    script_stock(stock, stock_script)
    script_longstraw(ours, ours_script)
    counts = Counts(ours)
    ref = stock._generate_and_score_completions([dict(r) for r in ENVIRONMENT_ROWS])
    out = ours._generate_and_score_completions([dict(r) for r in ENVIRONMENT_ROWS])
    assert sorted(ours_script.calls) == sorted(stock_script.calls)
    _assert_same_rollouts(ref, out, stock, ours, groups=2)
    # `environment` routes the row and is not forwarded to reset(); one reset per rollout, per trainer
    assert Counter.resets == [{}] * 8 and Echo.resets == [{}] * 8
    assert [e.count for e in ours.environments[:4]] == [1, 0, 3, 0]
    # 6 calls, 2 of them to the other environment's tool, which this rollout does not have
    assert ours._metrics["train"]["tools/failure_frequency"] == [pytest.approx(2 / 6)]
    for name in ("rewards/Counter/mean", "rewards/tool_reward/mean"):
        assert ours._metrics["train"][name] == stock._metrics["train"][name], name
    prompts = [ours.processing_class.decode(ids) for _, ids in out["longstraw_prompts"]]
    assert (
        "Count." in prompts[0] and '"name": "increment"' in prompts[0] and '"name": "shout"' not in prompts[0]
    )
    assert (
        "Echo." in prompts[1] and '"name": "shout"' in prompts[1] and '"name": "increment"' not in prompts[1]
    )
    assert sorted(counts.captured) == sorted(ids.numel() for _, ids in out["longstraw_prompts"])
    _assert_loss_parity(ref, out, stock, ours)


def test_environment_owned_data_needs_an_environment_column():
    from datasets import Dataset

    from longstraw_trl import LongStrawError

    with pytest.raises(LongStrawError, match="neither a 'prompt' nor an 'environment' column.*'counter'"):
        make_pair(
            "qwen3",
            environment_factory={"counter": Counter, "echo": Echo},
            dataset=Dataset.from_dict({"task": ["a"] * 4}),
        )


def test_injected_generate_matches_stock_trl():
    """TRL's tests script completions and tool calls by replacing `model.generate` on the instance: the trainer then
    draws through stock's generation call (first turn and tool turns), still capturing each group's prompt once for
    the log-probs and the loss; rollouts, tool metrics and loss equal stock's."""
    stock, ours = make_pair("qwen3", tools=[add, divide], max_tool_calling_iterations=2)
    stock_script, ours_script = (
        Script(stock.processing_class, SCRIPTS),
        Script(ours.processing_class, SCRIPTS),
    )
    for trainer, script in ((stock, stock_script), (ours, ours_script)):
        script_stock(trainer, script)  # the seam: an instance attribute `generate`
        trainer._metrics["train"].clear()
    counts = Counts(ours)
    ref = stock._generate_and_score_completions([dict(r) for r in ROWS])
    out = ours._generate_and_score_completions([dict(r) for r in ROWS])
    assert ours_script.calls == stock_script.calls and len(ours_script.calls) == 8
    _assert_same_rollouts(ref, out, stock, ours)
    # the group's prompt captured once; tool turns drawn by the injected generate need no state of their own
    assert counts.captured == [out["longstraw_prompts"][0][1].numel()] and counts.extended == []
    _assert_loss_parity(ref, out, stock, ours)


@pytest.mark.slow  # ~40 s; its parts: test_environment_owned_data_of_two_environments_matches_stock_trl,
# test_injected_generate_matches_stock_trl, and train() through the seam in test_trainer_dropin.py
def test_train_with_environments_and_injected_generate_logs_as_stock_trl():
    """`train()` end to end, as TRL's own multi-environment test runs it: environment-owned data from the dataloader,
    completions injected through `model.generate`; the logged tool metrics, rewards and loss equal stock's."""
    stock, ours = _environment_pair(max_steps=1, gradient_accumulation_steps=1)
    for trainer in (stock, ours):
        script_stock(trainer, ByObservation(trainer.processing_class, ENVIRONMENT_SCRIPTS))
        trainer.train()
    (ref,) = [h for h in stock.state.log_history if "loss" in h]
    (log,) = [h for h in ours.state.log_history if "loss" in h]
    assert log["tools/call_frequency"] == ref["tools/call_frequency"] > 0
    assert log["tools/failure_frequency"] == ref["tools/failure_frequency"] > 0
    for name in ("reward", "rewards/Counter/mean", "rewards/tool_reward/mean"):
        assert log[name] == pytest.approx(ref[name], abs=1e-6), name
    assert log["loss"] == pytest.approx(ref["loss"], abs=1e-5) and log["grad_norm"] > 0
    assert Counter.resets and Echo.resets and all(r == {} for r in Counter.resets + Echo.resets)
