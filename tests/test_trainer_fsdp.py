"""One LongStrawGRPOTrainer step with the policy sharded by FSDP2 over 2 CPU processes equals the single-process step.

Launched with ``accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision
no`` (the shipped 8-GPU config, on 2 processes, fp32). Accelerate applies its FSDP plugin only on accelerator devices;
``tests/_fsdp_shim.py`` lets it take that branch on CPU, where torch's ``fully_shard`` runs over gloo (all-gather and
reduce-scatter of the flat shards both run there).

- FSDP2 x CP2 (one mesh: the 2 ranks shard the weights and form one context-parallel group): both ranks hold the same
  responses and different prompt pages, and FSDP2's reduce-scatter averages their identical gradients: equal to the
  single-process step (a sum would double them).
- FSDP2 data parallel (``cp_size=1``): each rank samples from its own random stream (``_cp_step.DesyncRandomness``;
  TRL's ``seed + rank`` is not relied on: with LoRA under FSDP2 both ranks were seen sampling rank 0's stream); the
  reference is the mean of two single-process steps sampling with rank 0's and rank 1's streams (``loss_type="grpo"``: a mean per rank, so the
  average over ranks is the mean of the two steps).

The single-process references run in the test's own process (``_cp_step.main``); the FSDP2 steps are launched.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _cp_step import main as run_step
from _spawn import launch_step, relative_l2

from longstraw_trl import LongStrawError, LongStrawGRPOConfig, generate_from_state
from longstraw_trl.checks import check_launch, check_supported

STEP = Path(__file__).parent / "_cp_step.py"
FSDP2_CONFIG = Path(__file__).parent.parent / "examples" / "accelerate" / "fsdp2.yaml"


def _single(out: Path, *extra: str) -> dict:
    run_step(["--out", str(out), *extra])
    return json.loads(out.read_text())


def _fsdp2(out: Path, *extra: str) -> dict:
    return launch_step(FSDP2_CONFIG, out, *extra, num_processes=2)


def assert_step_matches(
    sharded: dict, grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor] | None, what: str
):
    """The FSDP2 step's gathered gradients (before the optimizer step) and parameters (after it, when ``params``)
    against the reference's: relative L2 of every tensor <= 1e-5. The gradients are the real check: Adam's first step
    is about ``lr * sign(grad)``, blind to a gradient counted twice."""
    assert set(sharded["grads"]) == set(grads) and grads
    assert any(g.abs().max() > 0 for g in grads.values())
    worst_grad = max(relative_l2(sharded["grads"][n], g) for n, g in grads.items())
    print(f"{what}: worst grad rel L2 {worst_grad:.2e}")
    assert worst_grad <= 1e-5
    if params is not None:
        assert set(sharded["params"]) == set(params)
        worst_param = max(relative_l2(sharded["params"][n], p) for n, p in params.items())
        print(f"{what}: worst updated parameter rel L2 {worst_param:.2e}")
        assert worst_param <= 1e-5


def _assert_matches_single(single: dict, sharded: dict, what: str) -> None:
    """The FSDP2 step's gathered gradients and updated parameters against the single-process step's."""
    grads = {n: torch.tensor(g) for n, g in single["grads"].items()}
    params = {n: torch.tensor(p) for n, p in single["params"].items()}
    assert_step_matches(sharded, grads, params, what)


def _world_one(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """The single-process step, and the same step under fsdp2.yaml on one process."""
    single = _single(tmp_path / "single.json", *extra)
    return single, launch_step(FSDP2_CONFIG, tmp_path / "fsdp.json", *extra, num_processes=1)


def _check_cp2(tmp_path: Path, *extra: str) -> None:
    single = _single(tmp_path / "single.json", *extra)
    sharded = _fsdp2(tmp_path / "fsdp.json", "--cp-size", "2", *extra)
    assert len(single["loss"]) == len(sharded["loss"]) == 1
    assert abs(single["loss"][0] - sharded["loss"][0]) <= 1e-5
    _assert_matches_single(single, sharded, f"FSDP2 x CP2 {' '.join(extra)}")


def test_fsdp2_cp2_full_gradient_step_equals_single_process(tmp_path):
    """Full fine-tuning, gradient_mode='full': the prompt backward's chunks reach FSDP2's per-layer gather too."""
    _check_cp2(tmp_path, "--gradient-mode", "full")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
@pytest.mark.parametrize("lora", [False, True], ids=["full_finetune", "lora"])
def test_fsdp2_cp2_step_equals_single_process(tmp_path, mode, lora):
    if mode == "full" and not lora:
        pytest.skip("the default-suite test above")
    _check_cp2(tmp_path, "--gradient-mode", mode, *(["--lora"] if lora else []))


@pytest.mark.slow
def test_fsdp2_cp2_lora_step_with_the_reference_model_equals_single_process(tmp_path):
    """beta > 0 with LoRA: the reference log-probs come from the same sharded model with its adapters switched off."""
    _check_cp2(tmp_path, "--lora", "--beta", "0.04")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
@pytest.mark.parametrize("lora", [False, True], ids=["full_finetune", "lora"])
def test_fsdp2_data_parallel_step_equals_the_mean_of_two_single_process_steps(tmp_path, mode, lora):
    extra = ["--loss-type", "grpo", "--gradient-mode", mode, *(["--lora"] if lora else [])]
    ranks = [_single(tmp_path / f"rank{r}.json", "--as-rank", str(r), *extra) for r in range(2)]
    sharded = _fsdp2(tmp_path / "fsdp.json", *extra)
    grads = {
        n: (torch.tensor(g) + torch.tensor(ranks[1]["grads"][n])) / 2 for n, g in ranks[0]["grads"].items()
    }
    # no reference for the parameters: the step from the mean gradient is neither single step (Adam normalises)
    assert_step_matches(sharded, grads, None, f"FSDP2 data parallel {' '.join(extra)}")


def test_fsdp2_wraps_only_the_layer_classes_the_model_has():
    """Accelerate's transformer-based wrap policy takes the model's ``_no_split_modules``; Qwen3.5's text model lists
    the vision tower's block too, which Accelerate cannot find (the whole 27B under FSDP2 failed with it on an
    H100). The trainer names only the classes the model has; a user's own choice is kept."""
    import accelerate
    from _models import build_hybrid
    from accelerate.utils import FullyShardedDataParallelPlugin
    from packaging.version import Version

    from longstraw_trl.fsdp import fit_fsdp_wrap_classes

    model = build_hybrid("qwen3_5")
    assert "Qwen3_5VisionBlock" in model._no_split_modules
    stock = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    if Version(accelerate.__version__) < Version("1.16"):  # 1.16 drops the classes a model lacks by itself
        with pytest.raises(ValueError, match="Qwen3_5VisionBlock"):
            stock.set_auto_wrap_policy(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    assert fit_fsdp_wrap_classes(plugin, model) == ["Qwen3_5VisionBlock"]
    assert plugin.transformer_cls_names_to_wrap == ["Qwen3_5DecoderLayer"]
    plugin.set_auto_wrap_policy(model)  # Accelerate's own step now passes
    wrapped = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert {c.__name__ for c in wrapped} == {"Qwen3_5DecoderLayer"}
    user = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Foo"]
    )
    assert fit_fsdp_wrap_classes(user, model) == [] and user.transformer_cls_names_to_wrap == ["Foo"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_on_the_gpu_goes_to_the_host_only_where_its_shards_would_not_fit_beside_it():
    """Accelerate holds the original parameters while FSDP2 copies them into shards (the whole 27B at world size 1 ran
    out of memory inside `prepare` on an H100): a model on the GPU moves to the host first where the shards would not
    fit beside it, and stays where they do. On the host already, nothing moves."""
    from _models import build_hybrid

    from longstraw_trl.fsdp import stage_on_host_for_fsdp2

    model = build_hybrid("qwen3_5")
    assert stage_on_host_for_fsdp2(model, 1, free_bytes=0) == 0
    model.cuda()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stage_on_host_for_fsdp2(model, 1, free_bytes=2**40) == 0 and all(
        p.is_cuda for p in model.parameters()
    )
    assert stage_on_host_for_fsdp2(model, 1) == 0  # a tiny model fits beside itself on any GPU
    assert stage_on_host_for_fsdp2(model, 2, free_bytes=0) >= weights
    assert not any(t.is_cuda for t in [*model.parameters(), *model.buffers()])


def test_fsdp2_data_parallel_step_on_the_hybrid_gdn_family(tmp_path):
    """The same FSDP2 data-parallel step on a tiny Qwen3.5 (GDN + attention), through train() under the shipped
    fsdp2.yaml: it failed at Accelerate's wrap policy before (the vision block above)."""
    extra = ["--loss-type", "grpo", "--family", "qwen3_5"]
    ranks = [_single(tmp_path / f"rank{r}.json", "--as-rank", str(r), *extra) for r in range(2)]
    sharded = _fsdp2(tmp_path / "fsdp.json", *extra)
    grads = {
        n: (torch.tensor(g) + torch.tensor(ranks[1]["grads"][n])) / 2 for n, g in ranks[0]["grads"].items()
    }
    assert_step_matches(sharded, grads, None, f"FSDP2 data parallel {' '.join(extra)}")


def test_a_second_trainer_on_an_fsdp2_sharded_model(tmp_path):
    """A fresh trainer on a model an earlier trainer sharded (bench/full_model.py's warm-up step, then the measured
    one; a notebook re-run): the layers are FSDP2's subclasses by then, which Accelerate's wrap policy did not find by
    name ("Could not find the transformer layer class Qwen3DecoderLayer"; the 27B under FSDP2 failed on an H100). Its
    step equals the same two trainers' second step in one process without FSDP2."""
    single, sharded = _world_one(tmp_path, "--lora", "--second-trainer")
    _assert_matches_single(single, sharded, "FSDP2 second trainer")


def test_fsdp2_step_on_a_bf16_model_with_fp32_lora_masters(tmp_path):
    """A bf16 model (as a real one loads) with peft's fp32 adapters under FSDP2's bf16 mixed precision: the graph-free
    passes cast adapters to the model's dtype, which on FSDP2's shards made FSDP2 take bf16 for the adapters' own
    dtype (it reads it at the first forward, the capture) and hand their fp32 masters a bf16 gradient ("attempting to
    assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'": the whole 27B at world size 1
    on an H100). The step equals the single-process one."""
    single, sharded = _world_one(tmp_path, "--lora", "--model-bf16", "--bf16")
    assert sharded["loss"] == pytest.approx(single["loss"], abs=1e-6)
    _assert_matches_single(single, sharded, "FSDP2 bf16 model, fp32 adapters")


@pytest.mark.parametrize("gib", ["0", "1"], ids=["per_token", "kept"])
def test_fsdp2_step_whatever_the_generation_gather_budget(tmp_path, gib):
    """`generation_fsdp_gather_gib` 0 (FSDP2 gathers every unit per decode token; the decode then stays out of a CUDA
    graph) or 1 GiB (the tiny model's units kept gathered through the generation): the FSDP2 step equals the
    single-process one either way."""
    single, sharded = _world_one(tmp_path, "--lora", "--generation-gather-gib", gib)
    _assert_matches_single(single, sharded, f"FSDP2, generation gather budget {gib} GiB")


def test_generation_keeps_fsdp2_units_gathered_within_the_budget(tmp_path, monkeypatch):
    """A decode step runs every layer for one token, and FSDP2 gathers each unit before its forward and frees it
    after: R tokens were R all-gathers of the whole model (at world size 1 a copy: the 27B's generation took 2.3x the
    unwrapped model's on an H100). Kept gathered within a memory budget, each unit is gathered once per
    generation, the tokens are the same, and every unit is sharded again afterwards; a budget of 0 keeps none."""
    import torch.distributed as dist
    from _models import build
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor

    from longstraw_trl import capture_prompt
    from longstraw_trl.fsdp import fsdp2_units_kept_gathered

    gathers = []
    unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        # counted where a gather happens (torch >= 2.12 aliases the shard at world size 1 rather than copying it)
        if group._all_gather_result is None and not group.is_unsharded:
            gathers.append(1)
        return unshard(group, *args, **kwargs)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = build("qwen3")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            state = capture_prompt(model, prompt, chunk_size=8, page_size=4)
        monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
        tokens, counts = {}, {}
        for budget in (0, None):
            gathers.clear()
            with torch.no_grad(), fsdp2_units_kept_gathered(model, budget) as still_gathering:
                tokens[budget] = generate_from_state(state, model, 2, 6, do_sample=False)
            counts[budget] = (still_gathering, len(gathers))
            # the layers are sharded again (the root stays gathered after its forward: FSDP2's own choice)
            assert all(isinstance(p, DTensor) for p in model.model.layers.parameters()), (
                "a layer was left gathered"
            )
    finally:
        dist.destroy_process_group()
    layers = len(model.model.layers)
    assert torch.equal(tokens[0], tokens[None])
    assert counts[0][0] == layers and counts[0][1] >= 6 * layers  # every token gathers every layer
    assert counts[None][0] == 0  # every layer kept (the root stays gathered after its forward anyway)
    assert counts[None][1] <= len(units)  # once each


def test_fsdp_version_1_deepspeed_and_accelerate_cp_are_refused(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=8)
    config = LongStrawGRPOConfig(**common)
    config.fsdp, config.fsdp_config = "full_shard", {"version": 1}  # as TrainingArguments parses them
    with pytest.raises(LongStrawError, match="FSDP version 1"):
        check_supported(config)
    config = LongStrawGRPOConfig(**common)
    config.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(LongStrawError, match="FSDP2 instead"):
        check_supported(config)
    # the launch: Accelerate's FSDP1 plugin, its own context parallelism
    fsdp1 = SimpleNamespace(
        distributed_type="FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=1), parallelism_config=None
    )
    with pytest.raises(LongStrawError, match="set `fsdp_version: 2`"):
        check_launch(fsdp1)
    accelerate_cp = SimpleNamespace(
        distributed_type="FSDP", fsdp_plugin=None, parallelism_config=SimpleNamespace(cp_size=2, tp_size=1)
    )
    with pytest.raises(LongStrawError, match="use LongStrawGRPOConfig.cp_size"):
        check_launch(accelerate_cp)
    fsdp2 = SimpleNamespace(
        distributed_type="FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=2), parallelism_config=None
    )
    check_launch(fsdp2)


@pytest.mark.parametrize("gib", [-1.0, float("nan")])
def test_a_negative_or_nan_generation_gather_budget_is_refused(gib):
    with pytest.raises(LongStrawError, match="generation_fsdp_gather_gib must be None or >= 0 GiB"):
        LongStrawGRPOConfig(
            output_dir="unused", use_cpu=True, report_to="none", generation_fsdp_gather_gib=gib
        )
