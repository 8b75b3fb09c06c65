"""Expert parallelism (transformers' EP) in one LongStrawGRPOTrainer step over CPU processes (gloo) equals the single-process
step (docs/parallelism.md).

The experts are split with transformers' own EP (``base_model_ep_plan``: ``grouped_gemm`` shards of the fused expert
weights, ``ep_dispatch_experts`` with ``ep_implementation="all_reduce"`` or ``"all_to_all"``; gloo runs both) over EP
groups inside the context-parallel groups, whose ranks hold the same batch. Launched with the shipped
``examples/accelerate/cp2.yaml`` (``--num_processes`` 2 or 4, ``--mixed_precision no``), compared with the
single-process step run in the test's own process (``_cp_step.main``), never with itself:

- EP2 x CP2 on 2 processes (tiny Qwen3-MoE, 4 experts; tiny GLM-5, 8 experts): each rank holds half the experts;
  every gradient (experts gathered from their owners) and every updated parameter within 1e-5 relative, the loss
  within 1e-5;
- DP2 x CP2 x EP2 on 4 processes (tiny GLM-5): two CP groups sample their own completions (``DesyncRandomness``),
  each expert lives on one rank of each group and its gradient is averaged over its two replicas; the reference is
  the mean of two single-process steps sampling with those ranks' streams (``loss_type="grpo"``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cp_step import main as run_step
from _models import build_glm_dsa
from _spawn import launch_step, relative_l2

from longstraw_trl import LongStrawError, LongStrawGRPOConfig, UnsupportedModelError
from longstraw_trl.distributed import check_expert_parallel

STEP = Path(__file__).parent / "_cp_step.py"
CP2_CONFIG = Path(__file__).parent.parent / "examples" / "accelerate" / "cp2.yaml"
TOL = 1e-5


def _single(out: Path, *extra: str) -> dict:
    run_step(["--out", str(out), *extra])
    return json.loads(out.read_text())


def _launch(out: Path, processes: int, *extra: str) -> dict:
    return launch_step(CP2_CONFIG, out, *extra, num_processes=processes, timeout=400)


def _assert_experts_split(sharded: dict, ep_size: int) -> None:
    """The rank's expert weights are DTensor shards of 1/ep_size of the experts (transformers' ``grouped_gemm``)."""
    full = {n: torch.tensor(p).numel() for n, p in sharded["params"].items()}
    local = sharded["local"]
    assert local, "no expert parameter was sharded"
    for name, shape in local.items():
        assert "experts" in name
        assert torch.Size(shape).numel() * ep_size == full[name], name


def _assert_grads(sharded: dict, grads: dict[str, torch.Tensor], what: str) -> float:
    assert set(sharded["grads"]) == set(grads) and grads
    assert any(g.abs().max() > 0 for n, g in grads.items() if "experts" in n)
    worst = max(relative_l2(sharded["grads"][n], g) for n, g in grads.items())
    print(f"{what}: worst grad rel L2 {worst:.2e}")
    assert worst <= TOL
    return worst


def _check_ep2_cp2(tmp_path: Path, *extra: str) -> None:
    single = _single(tmp_path / "single.json", *extra)
    sharded = _launch(tmp_path / "ep.json", 2, "--cp-size", "2", "--ep-size", "2", *extra)
    _assert_experts_split(sharded, 2)
    what = f"EP2 x CP2 {' '.join(extra)}"
    assert len(single["loss"]) == len(sharded["loss"]) == 1
    print(f"{what}: loss {sharded['loss'][0]:.8f} vs {single['loss'][0]:.8f}")
    assert abs(single["loss"][0] - sharded["loss"][0]) <= TOL
    _assert_grads(sharded, {n: torch.tensor(g) for n, g in single["grads"].items()}, what)
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


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["response_only", "full"])
def test_dp2_cp2_ep2_glm5_step_equals_the_mean_of_two_single_process_steps(tmp_path, mode):
    """4 processes: two CP groups of 2 (data parallel), each also an EP group; an expert's two replicas (ranks 0 and
    2, or 1 and 3) average their gradients, DDP averages the dense ones over the world."""
    extra = ["--family", "glm_moe_dsa", "--loss-type", "grpo", "--gradient-mode", mode]
    ranks = [_single(tmp_path / f"rank{r}.json", "--as-rank", str(r), *extra) for r in (0, 2)]
    sharded = _launch(tmp_path / "ep.json", 4, "--cp-size", "2", "--ep-size", "2", *extra)
    _assert_experts_split(sharded, 2)
    loss = (ranks[0]["loss"][0] + ranks[1]["loss"][0]) / 2
    print(f"DP2 x CP2 x EP2 {mode}: loss {sharded['loss'][0]:.8f} vs mean of singles {loss:.8f}")
    assert abs(sharded["loss"][0] - loss) <= TOL
    grads = {
        n: (torch.tensor(g) + torch.tensor(ranks[1]["grads"][n])) / 2 for n, g in ranks[0]["grads"].items()
    }
    _assert_grads(sharded, grads, f"DP2 x CP2 x EP2 {mode}")


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


def test_ep_on_a_dense_model_indivisible_experts_fsdp2_and_a_single_process_are_refused():
    from _models import build
    from _trl_helpers import tiny_qwen3_moe

    dense, moe = build("qwen3"), tiny_qwen3_moe()
    with pytest.raises(UnsupportedModelError, match="on a dense model"):
        check_expert_parallel(dense, 2, world=2)
    with pytest.raises(LongStrawError, match="does not divide the model's 4 routed experts"):
        check_expert_parallel(moe, 3, world=3)
    with pytest.raises(LongStrawError, match="needs a distributed launch"):
        check_expert_parallel(moe, 2, world=1)
    with pytest.raises(LongStrawError, match="with FSDP2 is not supported yet"):
        check_expert_parallel(moe, 2, world=2, fsdp=True)
    check_expert_parallel(moe, 2, world=4)
    check_expert_parallel(build_glm_dsa(), 4, world=4)  # GLM-5's 8 routed experts (n_routed_experts)
