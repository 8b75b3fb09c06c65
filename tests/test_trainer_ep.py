"""Expert parallelism (transformers' EP) in one LongStrawGRPOTrainer step over CPU processes (gloo) equals the single-process
step (docs/parallelism.md).

The experts are split with transformers' own EP (``base_model_ep_plan``: ``grouped_gemm`` shards of the fused expert
weights, ``ep_dispatch_experts`` with ``ep_implementation="all_reduce"`` or ``"all_to_all"``; gloo runs both) over EP
groups inside the context-parallel groups, whose ranks hold the same batch. Launched with the shipped
``examples/accelerate/cp2.yaml`` (DDP) or ``examples/accelerate/fsdp2.yaml`` (FSDP2: the dense parameters sharded over
the world, the experts left out of ``fully_shard``), ``--num_processes`` 2 or 4, ``--mixed_precision no``, compared
with the single-process step run in the test's own process (``_cp_step.main``), never with itself:

- EP2 x CP2 on 2 processes (tiny Qwen3-MoE, Qwen3.5-MoE, GPT-OSS: 4 experts; tiny GLM-4.5, GLM-5: 8 experts), under
  DDP or FSDP2: each rank holds half the experts; every gradient (experts gathered from their owners) and every
  updated parameter within 1e-5 relative, the loss within 1e-5; with ``max_grad_norm`` below the norm, the logged norm
  within 1e-5 relative too;
- DP2 x CP2 x EP2 on 4 processes (tiny GLM-5; tiny Qwen3-MoE clipped), under DDP or FSDP2: two CP groups sample their
  own completions (``DesyncRandomness``), each expert lives on one rank of each group and its gradient is averaged over
  its two replicas; the reference is the mean of two single-process steps sampling with those ranks' streams
  (``loss_type="grpo"``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _cp_step import main as run_step
from _models import build_glm_dsa
from _spawn import launch_step, relative_l2

from longstraw_trl import LongStrawError, LongStrawGRPOConfig, UnsupportedModelError
from longstraw_trl.expert_parallel import check_expert_parallel

STEP = Path(__file__).parent / "_cp_step.py"
CP2_CONFIG = Path(__file__).parent.parent / "examples" / "accelerate" / "cp2.yaml"
FSDP2_CONFIG = Path(__file__).parent.parent / "examples" / "accelerate" / "fsdp2.yaml"
TOL = 1e-5


def _single(out: Path, *extra: str) -> dict:
    run_step(["--out", str(out), *extra])
    return json.loads(out.read_text())


def _launch(out: Path, processes: int, *extra: str, fsdp: bool = False, config: Path | None = None) -> dict:
    config = config or (FSDP2_CONFIG if fsdp else CP2_CONFIG)
    return launch_step(config, out, *extra, num_processes=processes, timeout=400)


def _hsdp_config(tmp_path: Path) -> Path:
    """The shipped fsdp2.yaml with Accelerate's ``parallelism_config`` of 2 replicas x 2 shards (HSDP: FSDP2 on a
    ``(dp_replicate, dp_shard_cp)`` mesh)."""
    config = tmp_path / "hsdp.yaml"
    config.write_text(
        FSDP2_CONFIG.read_text()
        + "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
    )
    return config


def _assert_experts_split(sharded: dict, ep_size: int, fsdp_world: int | None = None) -> None:
    """The rank's routed expert weights are DTensor shards of 1/ep_size of the experts (transformers' ``grouped_gemm``)
    on the EP mesh. Under FSDP2 (``fsdp_world`` ranks) every other parameter is a shard of FSDP2's mesh over the world
    (the experts left out of ``fully_shard``); under DDP no other parameter is a DTensor."""
    full = {n: torch.tensor(p).numel() for n, p in sharded["params"].items()}
    local, meshes = sharded["local"], sharded["meshes"]
    experts = {n for n in full if ".mlp.experts." in n}
    assert experts and experts <= set(local), "not every routed expert parameter was sharded"
    for name in experts:
        assert meshes[name] == [["ep"], ep_size], (name, meshes[name])
        assert torch.Size(local[name]).numel() * ep_size == full[name], name
    dense = set(full) - experts
    if fsdp_world is None:
        assert not dense & set(local), sorted(dense & set(local))
        return
    for name in dense:
        assert name in local and meshes[name][1] == fsdp_world and "ep" not in meshes[name][0], name
        numel = torch.Size(local[name]).numel()
        assert numel < full[name] <= numel * fsdp_world, (
            name
        )  # rank 0 holds its rows of every dense parameter


def _assert_grads(sharded: dict, grads: dict[str, torch.Tensor], what: str) -> float:
    assert set(sharded["grads"]) == set(grads) and grads
    assert any(g.abs().max() > 0 for n, g in grads.items() if "experts" in n)
    worst = max(relative_l2(sharded["grads"][n], g) for n, g in grads.items())
    print(f"{what}: worst grad rel L2 {worst:.2e}")
    assert worst <= TOL
    return worst


def _check_ep2_cp2(tmp_path: Path, *extra: str, fsdp: bool = False, clip: float | None = None) -> None:
    """EP2 x CP2 on 2 processes (under FSDP2 with ``fsdp``: the dense parameters in halves too) against the single
    process. ``clip``: train with ``max_grad_norm=clip``, checked to clip (the single step's norm above it, the recorded
    gradients scaled down to it), the logged norms within 1e-5 relative."""
    extra = (*extra, *(["--max-grad-norm", str(clip)] if clip else []))
    single = _single(tmp_path / "single.json", *extra)
    sharded = _launch(tmp_path / "ep.json", 2, "--cp-size", "2", "--ep-size", "2", *extra, fsdp=fsdp)
    _assert_experts_split(sharded, 2, fsdp_world=2 if fsdp else None)
    what = f"{'FSDP2 x ' if fsdp else ''}EP2 x CP2 {' '.join(extra)}"
    assert len(single["loss"]) == len(sharded["loss"]) == 1
    print(f"{what}: loss {sharded['loss'][0]:.8f} vs {single['loss'][0]:.8f}")
    assert abs(single["loss"][0] - sharded["loss"][0]) <= TOL
    grads = {n: torch.tensor(g) for n, g in single["grads"].items()}
    if clip:
        norm, got = single["grad_norm"][0], sharded["grad_norm"][0]
        clipped = float(torch.stack([g.norm() for g in grads.values()]).norm())
        print(f"{what}: grad norm {got:.8f} vs {norm:.8f}, clipped to {clipped:.6f}")
        assert norm > 2 * clip and abs(clipped - clip) <= 1e-3 * clip  # it clipped, by more than half
        assert abs(got - norm) <= TOL * norm
    _assert_grads(sharded, grads, what)
    worst = max(relative_l2(sharded["params"][n], torch.tensor(p)) for n, p in single["params"].items())
    print(f"{what}: worst updated parameter rel L2 {worst:.2e}")
    assert worst <= TOL


def test_ep2_cp2_qwen3_moe_step_equals_single_process(tmp_path):
    """2 processes, one CP group of 2 that is also the EP group: half the experts on each rank."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
@pytest.mark.parametrize("family", ["qwen3_moe", "glm_moe_dsa"])
def test_ep2_cp2_step_equals_single_process(tmp_path, family, mode):
    if family == "qwen3_moe" and mode == "response_only":
        pytest.skip("the default-suite test above")
    _check_ep2_cp2(tmp_path, "--family", family, "--gradient-mode", mode)


def test_ep2_cp2_glm5_lora_step_equals_single_process(tmp_path):
    """LoRA on the attention of a GLM-5 whose experts are split (the experts frozen, no adapter on them): the loss,
    every adapter's gradient and update within 1e-5 of the single process."""
    extra = ("--family", "glm_moe_dsa", "--lora")
    single = _single(tmp_path / "single.json", *extra)
    sharded = _launch(tmp_path / "ep.json", 2, "--cp-size", "2", "--ep-size", "2", *extra)
    _assert_experts_split(sharded, 2)
    assert abs(single["loss"][0] - sharded["loss"][0]) <= TOL
    grads = {n: torch.tensor(g) for n, g in single["grads"].items()}
    assert grads and all("lora_" in n for n in grads) and set(sharded["grads"]) == set(grads)
    assert any(g.abs().max() > 0 for g in grads.values())
    worst = max(relative_l2(sharded["grads"][n], g) for n, g in grads.items())
    worst_param = max(relative_l2(sharded["params"][n], torch.tensor(p)) for n, p in single["params"].items())
    print(f"LoRA EP2 x CP2: loss {sharded['loss'][0]:.8f} vs {single['loss'][0]:.8f}, grads {worst:.2e}, "
          f"params {worst_param:.2e}")  # fmt: skip
    assert worst <= TOL and worst_param <= TOL


@pytest.mark.parametrize("targets", ["all-linear", ["o_proj", "down_proj"]])
def test_lora_that_reaches_the_experts_is_refused_with_the_fix(targets):
    """PEFT maps "all-linear" and the MLP projection names onto a transformers-5 MoE model's fused experts: EP refuses
    the wrapped experts and says to name the attention projections."""
    from peft import LoraConfig, get_peft_model
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from longstraw_trl.expert_parallel import ExpertParallel

    model = get_peft_model(build_glm_dsa(index_topk=8), LoraConfig(r=2, target_modules=targets))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(LongStrawError, match="PEFT also maps the MLP projection names"):
            ExpertParallel(model.get_base_model(), 2)
    finally:
        dist.destroy_process_group()


def test_ep2_cp2_qwen3_5_moe_step_equals_single_process(tmp_path):
    """Qwen3.5 / 3.6 MoE (GDN and gated attention, a shared expert beside the routed ones)."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_5_moe")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss"])
def test_ep2_cp2_other_families_step_equals_single_process(tmp_path, family):
    """GLM-4.5 class (a dense first layer, grouped sigmoid router, shared expert) and GPT-OSS (sliding windows, sinks,
    expert biases, which its EP plan shards with the weights)."""
    _check_ep2_cp2(tmp_path, "--family", family)


def test_fsdp2_ep2_cp2_qwen3_moe_step_equals_single_process(tmp_path):
    """FSDP2 x EP2 x CP2 on 2 processes (the shipped fsdp2.yaml): the dense parameters in halves by FSDP2 over the
    world, the experts split by EP and left out of fully_shard; FSDP2's reduce-scatter averages the CP ranks' identical
    dense gradients, the experts are reduced by nobody (one EP group, no replicas)."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_moe", fsdp=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
def test_fsdp2_ep2_cp2_glm5_step_equals_single_process(tmp_path, mode):
    """GLM-5 (dense layers, shared expert, MLA + DSA) under FSDP2 x EP2 x CP2, both gradient modes (the full gradient's
    chunk recomputes gather FSDP2's layers around the experts)."""
    _check_ep2_cp2(tmp_path, "--family", "glm_moe_dsa", "--gradient-mode", mode, fsdp=True)


def test_ep2_cp2_clipped_step_equals_single_process(tmp_path):
    """max_grad_norm well below the gradient norm: transformers' norm of mixed meshes (the dense gradients, the experts'
    shards summed over the EP mesh, each expert once) and the clipped gradients as the single process's."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_moe", clip=0.05)


@pytest.mark.slow
def test_fsdp2_ep2_cp2_clipped_step_equals_single_process(tmp_path):
    """Clipping under FSDP2 x EP2 x CP2: two meshes of DTensor gradients (FSDP2's over the world, the experts' EP)."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_moe", fsdp=True, clip=0.05)


@pytest.mark.slow
def test_ep2_cp2_all_to_all_step_equals_single_process(tmp_path):
    """transformers' all-to-all dispatch (the shared batch sliced over the EP group, tokens exchanged)."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_moe", "--ep-implementation", "all_to_all")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
def test_ep2_cp2_router_aux_loss_step_equals_single_process(tmp_path, mode):
    """TRL's router load-balancing loss with the experts split: the routers are replicated and every rank of the group
    routes every token, so the statistics need no gathering (router_aux.py)."""
    _check_ep2_cp2(tmp_path, "--family", "qwen3_moe", "--router-aux", "0.3", "--gradient-mode", mode)


def test_ep2_cp2_full_finetune_checkpoint_holds_every_expert(tmp_path):
    """``trainer.save_model`` of an expert-parallel model (full fine-tuning, DDP), called on every rank as the
    Trainer's checkpointing does: the checkpoint, reloaded, holds the trained model whole (each expert from its
    owner). transformers' own path let only the writing rank gather the expert DTensors, which waited for the
    other rank forever (or aborted)."""
    sharded = _launch(
        tmp_path / "ep.json", 2, "--cp-size", "2", "--ep-size", "2", "--family", "qwen3_moe",
        "--save", str(tmp_path / "saved"),
    )  # fmt: skip
    _assert_experts_split(sharded, 2)
    saved, params = sharded["saved"], sharded["params"]
    # the checkpoint's names are the model's (the parameters' names in the step are the same model's)
    assert saved is not None and set(params) <= set(saved), sorted(set(params) - set(saved or {}))[:5]
    worst = max(relative_l2(saved[n], torch.tensor(p)) for n, p in params.items())
    print(f"EP2 x CP2 checkpoint against the trained parameters: worst rel L2 {worst:.2e}")
    assert worst == 0.0


def _check_dp2_cp2_ep2(
    tmp_path: Path, *extra: str, fsdp: bool = False, clip: float | None = None, hsdp: bool = False
) -> dict:
    """4 processes: two CP groups of 2 (data parallel), each also an EP group; an expert's two replicas (ranks 0 and
    2, or 1 and 3) average their gradients; the dense ones are averaged over the world by DDP, or by FSDP2's
    reduce-scatter (``fsdp``: in quarters). Against the mean of two single-process steps sampling with the two groups'
    streams (``loss_type="grpo"``). ``clip``: the norm of that mean gradient, clipped (checked to clip). ``hsdp``:
    FSDP2 as 2 replicas x 2 shards (the dense parameters in halves, averaged over both dimensions)."""
    fsdp = fsdp or hsdp
    extra = ["--loss-type", "grpo", *extra]
    ranks = [_single(tmp_path / f"rank{r}.json", "--as-rank", str(r), *extra) for r in (0, 2)]
    launched = [*extra, *(["--max-grad-norm", str(clip)] if clip else [])]
    config = _hsdp_config(tmp_path) if hsdp else None
    sharded = _launch(
        tmp_path / "ep.json", 4, "--cp-size", "2", "--ep-size", "2", *launched, fsdp=fsdp, config=config
    )
    _assert_experts_split(sharded, 2, fsdp_world=4 if fsdp else None)
    what = f"{'HSDP 2x2 x ' if hsdp else 'FSDP2 x ' if fsdp else ''}DP2 x CP2 x EP2 {' '.join(launched)}"
    loss = (ranks[0]["loss"][0] + ranks[1]["loss"][0]) / 2
    print(f"{what}: loss {sharded['loss'][0]:.8f} vs mean of singles {loss:.8f}")
    assert abs(sharded["loss"][0] - loss) <= TOL
    grads = {
        n: (torch.tensor(g) + torch.tensor(ranks[1]["grads"][n])) / 2 for n, g in ranks[0]["grads"].items()
    }
    if clip:
        norm = float(torch.stack([g.norm() for g in grads.values()]).norm())
        got = sharded["grad_norm"][0]
        print(f"{what}: grad norm {got:.8f} vs the mean gradient's {norm:.8f}")
        assert norm > 2 * clip and abs(got - norm) <= TOL * norm
        grads = {n: g * (clip / (norm + 1e-6)) for n, g in grads.items()}  # torch's clip coefficient
    _assert_grads(sharded, grads, what)
    return sharded


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
def test_dp2_cp2_ep2_glm5_step_equals_the_mean_of_two_single_process_steps(tmp_path, mode):
    _check_dp2_cp2_ep2(tmp_path, "--family", "glm_moe_dsa", "--gradient-mode", mode)


@pytest.mark.slow
def test_dp2_cp2_ep2_clipped_step_equals_the_clipped_mean_of_two_single_process_steps(tmp_path):
    """Clipping with expert replicas: the experts' norm after their replica average, each expert counted once."""
    _check_dp2_cp2_ep2(tmp_path, "--family", "qwen3_moe", clip=0.02)


@pytest.mark.slow
def test_fsdp2_dp2_cp2_ep2_glm5_step_equals_the_mean_of_two_single_process_steps(tmp_path):
    """FSDP2 over 4 ranks x two CP groups of 2, each an EP group: dense gradients reduce-scattered (averaged) over the
    world, each expert averaged over its 2 replicas by ExpertParallel.reduce_gradients and by nothing else."""
    _check_dp2_cp2_ep2(tmp_path, "--family", "glm_moe_dsa", fsdp=True)


@pytest.mark.slow
def test_hsdp_dp2_cp2_ep2_step_equals_the_mean_of_two_single_process_steps(tmp_path):
    """The whole mesh, dp_replicate x dp_shard x cp x ep on 4 processes: FSDP2 as 2 replicas x 2 shards
    (Accelerate's parallelism_config), two CP groups of 2, each an EP group; the dense parameters in halves on the 2-D
    mesh, averaged over both of its dimensions, the experts averaged over their replicas only."""
    sharded = _check_dp2_cp2_ep2(tmp_path, "--family", "qwen3_moe", hsdp=True)
    assert {tuple(names) for names, _ in sharded["meshes"].values()} == {
        ("dp_replicate", "dp_shard_cp"),
        ("ep",),
    }
    dense = [n for n in sharded["local"] if ".mlp.experts." not in n]
    assert all(
        torch.Size(sharded["local"][n]).numel() * 2 >= torch.tensor(sharded["params"][n]).numel()
        for n in dense
    )


def test_ep_sizes_are_validated(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=8)
    with pytest.raises(LongStrawError, match="ep_size must be >= 1"):
        LongStrawGRPOConfig(**common, ep_size=0)
    with pytest.raises(LongStrawError, match="ep_size=2 must divide cp_size=1"):
        LongStrawGRPOConfig(**common, ep_size=2)
    with pytest.raises(LongStrawError, match="ep_size=4 must divide cp_size=2"):
        LongStrawGRPOConfig(**common, ep_size=4, cp_size=2)
    with pytest.raises(LongStrawError, match="ep_implementation must be one of all_reduce, all_to_all"):
        LongStrawGRPOConfig(**common, ep_size=2, cp_size=2, ep_implementation="deepgemm_megamoe")
    LongStrawGRPOConfig(**common, ep_size=2, cp_size=4)  # two EP groups inside each CP group of 4


def test_ep_on_a_dense_model_indivisible_experts_an_fsdp2_model_and_a_single_process_are_refused():
    from _models import build
    from _trl_helpers import tiny_qwen3_moe

    dense, moe = build("qwen3"), tiny_qwen3_moe()
    with pytest.raises(UnsupportedModelError, match="on a dense model"):
        check_expert_parallel(dense, 2, world=2)
    with pytest.raises(LongStrawError, match="does not divide the model's 4 routed experts"):
        check_expert_parallel(moe, 3, world=3)
    with pytest.raises(LongStrawError, match="needs a distributed launch"):
        check_expert_parallel(moe, 2, world=1)
    with pytest.raises(LongStrawError, match="already sharded by FSDP2"):
        check_expert_parallel(moe, 2, world=2, fsdp=True)
    check_expert_parallel(moe, 2, world=4)
    check_expert_parallel(build_glm_dsa(), 4, world=4)  # GLM-5's 8 routed experts (n_routed_experts)


def test_keep_out_of_fsdp_adds_the_expert_modules_to_accelerates_ignored_modules():
    """What the trainer hands Accelerate's FSDP2 plugin (``ignored_modules``, which ``fsdp2_prepare_model`` passes to
    every ``fully_shard`` as ``ignored_params``): exactly the modules of the split experts, after a user's own modules
    or name regex, without duplicates. On rank 0 of a fake group of 2 (no collective runs)."""
    from types import SimpleNamespace

    from _trl_helpers import tiny_qwen3_moe
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from longstraw_trl.expert_parallel import ExpertParallel

    model = tiny_qwen3_moe(router_aux_loss_coef=0.0)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        ep = ExpertParallel(model, 2)
    finally:
        dist.destroy_process_group()
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert {id(p) for m in experts for p in m.parameters()} == {id(p) for p in ep.parameters}
    plugin = SimpleNamespace(ignored_modules=None)
    ep.keep_out_of_fsdp(plugin, model)
    assert plugin.ignored_modules == experts
    plugin = SimpleNamespace(ignored_modules=r"model\.embed_tokens")
    ep.keep_out_of_fsdp(plugin, model)
    assert plugin.ignored_modules == [model.model.embed_tokens, *experts]
    plugin = SimpleNamespace(ignored_modules=[experts[1], model.lm_head])
    ep.keep_out_of_fsdp(plugin, model)
    assert plugin.ignored_modules == [experts[1], model.lm_head, experts[0]]
