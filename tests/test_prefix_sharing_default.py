"""Prefix sharing under the defaults (`prompt_prefix_sharing="batch"`): the common prefix at which a generation
batch's prompts branch is captured once and the prompts extend it, and no state is kept at capture-chunk boundaries;
`"all"` (or `True`) also keeps those, for prompts of later batches that branch inside a cached state; `"off"` (or
`False`) captures each prompt whole.

The prompts are decision points of one history that are not prefixes of each other, on a plain GQA model (Qwen3) and
a GDN hybrid (Qwen3.5), in fp32: the replays on each shared state equal those on a whole capture of the prompt.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _reference import padded_completions
from test_prefix_tree import MODELS, _decision_points, sibling_log_and_ids, sibling_trainer
from test_streamed_loss import Host
from transformers import HfArgumentParser

from longstraw_trl import LongStrawGRPOConfig, capture_prompt, replay_logprobs
from longstraw_trl.cli import main
from longstraw_trl.constants import PrefixSharing
from longstraw_trl.errors import LongStrawError
from longstraw_trl.options import CaptureOptions
from longstraw_trl.planner import PlanInputs, plan_memory, shared_prefix_boundary_bytes
from longstraw_trl.presets import preset_config
from longstraw_trl.prompt_state_manager import PromptStateManager
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.state_cache import prompt_key

CHUNK = 8
ATOL = 1e-5


def _config(tmp_path, **overrides) -> LongStrawGRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        capture_chunk_size=CHUNK,
    )
    return LongStrawGRPOConfig(**{**kwargs, **overrides})


def _manager(model, config: LongStrawGRPOConfig) -> tuple[PromptStateManager, Host]:
    """The prompt states as the trainer builds them from its config (`LongStrawGRPOTrainer._build_step`)."""
    policy = RefreshPolicy(
        config.refresh_policy,
        config.refresh_interval,
        config.refresh_drift_threshold,
        config.refresh_probe_period,
        config.refresh_max_interval,
    )
    host = Host()
    cache_bytes = int(config.prompt_cache_gib * 2**30)
    return PromptStateManager(host, model, CaptureOptions.from_config(config), policy, cache_bytes), host


def _acquire(states: PromptStateManager, host: Host, prompts) -> tuple[list, dict[str, float]]:
    with states.generation_batch():
        keys, entries = states.acquire_groups(prompts, num_generations=1)
    states.flush_counts("train", host.metrics)
    counts = {name: values[-1] for name, values in host.metrics.items()}
    return [entries[k] for k in keys], counts


def _assert_replays_match_whole_capture(model, state, prompt_ids, page_size, seed=0):
    comps, mask = padded_completions([5, 3], torch.Generator().manual_seed(seed))
    comps = (
        comps % model.get_output_embeddings().out_features
    )  # the tiny trainer's model has the toy vocabulary
    with torch.no_grad():
        got = replay_logprobs(state, model, comps, mask)
        whole = capture_prompt(model, prompt_ids, chunk_size=CHUNK, page_size=page_size)
        want = replay_logprobs(whole, model, comps, mask)
    torch.testing.assert_close(got * mask, want * mask, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("batch", PrefixSharing.BATCH),
        ("all", PrefixSharing.ALL),
        ("off", PrefixSharing.OFF),
        (True, PrefixSharing.ALL),
        (False, PrefixSharing.OFF),
        (" All ", PrefixSharing.ALL),
        ("True", PrefixSharing.ALL),
        ("false", PrefixSharing.OFF),
        (PrefixSharing.BATCH, PrefixSharing.BATCH),
    ],
)
def test_config_accepts_the_sharing_modes(tmp_path, value, mode):
    config = _config(tmp_path, prompt_prefix_sharing=value)
    assert config.prompt_prefix_sharing is mode
    capture = CaptureOptions.from_config(config)
    assert capture.prompt_prefix_sharing is mode
    assert capture.batch_trunks is (mode is not PrefixSharing.OFF)
    assert capture.keep_boundaries is (mode is PrefixSharing.ALL)
    assert config.to_dict()["prompt_prefix_sharing"] == mode.value


def test_config_default_is_batch_and_a_bad_value_is_refused(tmp_path):
    config = _config(tmp_path)
    assert config.prompt_prefix_sharing is PrefixSharing.BATCH and config.prompt_prefix_sharing == "batch"
    assert CaptureOptions().prompt_prefix_sharing is config.prompt_prefix_sharing
    with pytest.raises(LongStrawError, match="prompt_prefix_sharing must be one of 'off', 'batch', 'all'"):
        _config(tmp_path, prompt_prefix_sharing="sometimes")
    with pytest.raises(ValueError, match="'off', 'batch', 'all'"):
        CaptureOptions(prompt_prefix_sharing=1.5)


def test_command_line_strings_parse(tmp_path):
    """TRL scripts parse the config from the command line (`HfArgumentParser`): the modes and `True` / `False`."""
    parser = HfArgumentParser(LongStrawGRPOConfig)
    for given, mode in (("all", PrefixSharing.ALL), ("True", PrefixSharing.ALL), ("off", PrefixSharing.OFF)):
        argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--prompt_prefix_sharing", given]
        (config,) = parser.parse_args_into_dataclasses(argv)
        assert config.prompt_prefix_sharing is mode, given
    (config,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "true"])
    assert config.prompt_prefix_sharing is PrefixSharing.BATCH


@pytest.mark.parametrize("family", list(MODELS))
def test_default_captures_a_batch_trunk_once_and_keeps_no_boundaries(tmp_path, family):
    model = MODELS[family]()
    prompts = (
        _decision_points()
    )  # a 37-token history, then branches; the third forks the first after 4 tokens
    config = _config(tmp_path)
    states, host = _manager(model, config)
    assert states.cache.prompt_prefix_sharing is False  # no branch off a cached prompt across batches
    entries, counts = _acquire(states, host, prompts)
    shared, fork = 37, 4
    assert counts["longstraw/prefix_trunks"] == 2
    assert counts["longstraw/tokens_captured"] == sum(p.numel() for p in prompts) - 2 * shared - fork
    for i, entry in enumerate(entries):
        assert not entry.state.boundaries  # a response-only capture keeps nothing at chunk boundaries
        _assert_replays_match_whole_capture(model, entry.state, entry.prompt_ids, config.page_size, seed=i)
    trunks = [e for k, e in states.cache.entries.items() if k not in {x.key for x in entries}]
    assert sorted(e.prompt_ids.numel() for e in trunks) == [shared, shared + fork]
    assert all(not e.state.boundaries for e in trunks)

    # "all": the same trunks, and the policy captures keep the fixed-size layers' states at the boundaries
    every, every_host = _manager(model, _config(tmp_path, prompt_prefix_sharing="all"))
    assert every.cache.prompt_prefix_sharing is True
    all_entries, all_counts = _acquire(every, every_host, prompts)
    assert all_counts["longstraw/prefix_trunks"] == 2
    assert all_counts["longstraw/tokens_captured"] == counts["longstraw/tokens_captured"]
    assert all(entry.state.boundaries for entry in all_entries)  # kept at 8, 16, ... (GDN: its states there)

    # "off": each prompt whole
    whole, whole_host = _manager(model, _config(tmp_path, prompt_prefix_sharing=False))
    _, whole_counts = _acquire(whole, whole_host, prompts)
    assert whole_counts["longstraw/prefix_trunks"] == 0
    assert whole_counts["longstraw/tokens_captured"] == sum(p.numel() for p in prompts)


def test_planner_counts_kept_boundaries_for_all_only():
    config = preset_config("qwen3.6-27b", 8)
    prompt = 1 << 19
    default, off, every = (
        plan_memory(config, prompt, **o) for o in ({}, {"prefix_sharing": False}, {"prefix_sharing": "all"})
    )
    assert PlanInputs().prompt_prefix_sharing is PrefixSharing.BATCH
    assert default.kept_boundaries == off.kept_boundaries == 0 and default.peak == off.peak
    assert every.kept_boundaries == shared_prefix_boundary_bytes(config, prompt, chunk_size=16384) > 0
    # a trunk's own GDN states: noted, not counted
    assert any("each trunk" in note for note in default.notes) and not any(
        "each trunk" in n for n in off.notes
    )
    assert plan_memory(config, prompt, prefix_sharing=True) == every


@pytest.mark.parametrize(
    ("flags", "kept"),
    [
        ([], False),
        (["--prefix-sharing"], True),
        (["--prefix-sharing", "all"], True),
        (["--no-prefix-sharing"], False),
    ],
)
def test_plan_command_counts_kept_boundaries_for_all_only(capsys, flags, kept):
    main(
        ["plan", "qwen3.6-27b", "--prompt", "65536", *flags, "--json"]
    )  # 1: the full fine-tuning does not fit
    plan = json.loads(capsys.readouterr().out)
    assert (plan["kept_boundaries"] > 0) is kept


def _train_one_step(family: str, **options):
    """One `trainer.train()` step on the sibling prompts with TRL's and LongStraw's defaults (no weight update, so that
    the cached states are the weights' own); also the cache's entries once the batch's states are built (the trainer
    drops them when `train()` returns)."""
    trainer = sibling_trainer(family, learning_rate=0.0, **options)
    held: dict = {}
    acquire = trainer.prompt_states.acquire_groups

    def acquire_and_record(prompt_ids, num_generations):
        out = acquire(prompt_ids, num_generations)
        held.update(trainer.prompt_cache.entries)
        return out

    trainer.prompt_states.acquire_groups = acquire_and_record
    trainer.train()
    log, ids = sibling_log_and_ids(trainer)
    return trainer, log, ids, held


@pytest.mark.parametrize("family", list(MODELS))
def test_default_train_step_captures_the_shared_prefix_once(family):
    trainer, log, (a, b), held = _train_one_step(family)
    assert trainer.args.prompt_prefix_sharing is PrefixSharing.BATCH
    trunk = next(i for i in range(min(a.numel(), b.numel())) if a[i] != b[i])
    assert trunk > 2 * CHUNK and log["longstraw/prefix_trunks"] == 1
    assert log["longstraw/tokens_captured"] == a.numel() + b.numel() - trunk
    assert log["longstraw/tokens_reused"] == 2 * trunk
    model = trainer.model.eval()
    for i, ids in enumerate((a, b)):
        entry = held[prompt_key(ids)]
        assert entry.parent == prompt_key(a[:trunk]) and not entry.state.boundaries
        assert not held[entry.parent].state.boundaries
        _assert_replays_match_whole_capture(model, entry.state, ids, trainer.args.page_size, seed=i)
    # the step's loss is the one of capturing each prompt whole
    _, whole_log, _, _ = _train_one_step(family, prompt_prefix_sharing="off")
    assert whole_log["longstraw/prefix_trunks"] == 0
    assert whole_log["longstraw/tokens_captured"] == a.numel() + b.numel()
    assert math.isclose(log["loss"], whole_log["loss"], rel_tol=1e-5, abs_tol=1e-6)
