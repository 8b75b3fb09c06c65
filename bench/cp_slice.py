"""Context parallelism on several GPUs: the prompt pages of a real-dimension slice spread over CP ranks.

    python -m torch.distributed.run --nproc_per_node 2 bench/cp_slice.py --preset qwen3.6-27b --prompt 2097152

Every rank holds the whole (replicated) model and GDN state and 1/cp of the K/V pages. Checks first, at a
small P, that the sharded state's log-probs equal a single-rank capture on the same GPU and that the
parameter gradients are identical on all ranks; then captures P, replays G responses with backward and
samples G responses from the shared state, replays them with backward (``--cycles`` times on the same
prefix) and reports per-rank peak memory, state bytes, capture, generation and replay seconds, with
what ``longstraw plan`` predicts for the whole model at the same sizes. Rank 0 writes the JSON.

    python -m torch.distributed.run --nproc_per_node 8 bench/cp_slice.py --prompt 4456448 --cycles 8

``--check-only --backend gloo`` runs only the small-P checks, and lets several ranks share one GPU (gloo
moves CUDA tensors through the host; NCCL refuses two ranks on one device): the GPU kernels whose
nondeterminism the gradient check guards against still run on every rank.

    python -m torch.distributed.run --nproc_per_node 2 bench/cp_slice.py --check-only --backend gloo
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import (
    GiB,
    Timer,
    mean_after_first,
    peak_gib,
    print_table,
    process_group,
    reset_peak,
    write_result,
)
from engine_slice import full_attention_layers, slice_config
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt, generate_from_state, replay_logprobs
from longstraw_trl.planner import plan_memory
from longstraw_trl.presets import preset_config


def grad_checksum(model) -> torch.Tensor:
    return torch.stack([p.grad.float().sum() for p in model.parameters() if p.grad is not None])


def full_model_predictions(args, cp_size: int) -> dict:
    """What ``longstraw plan`` predicts per rank for the whole model (all its layers) at this run's sizes."""
    config = preset_config(args.preset)
    variants = {
        "full fine-tuning, AdamW": dict(optimizer="adamw"),
        "full fine-tuning, AdamW, checkpointed layers": dict(optimizer="adamw", checkpoint_layers=True),
        "LoRA r=64, AdamW, checkpointed layers": dict(lora_rank=64, checkpoint_layers=True),
    }
    out = {}
    for name, kwargs in variants.items():
        plan = plan_memory(
            config,
            args.prompt,
            num_generations=args.generations,
            response_tokens=args.response,
            cp_size=cp_size,
            capture_chunk_size=args.chunk,
            page_size=args.page,
            **kwargs,
        )
        out[name] = {
            "layers": config.num_hidden_layers,
            "peak_gib": plan.peak / GiB,
            "state_gib": plan.state / GiB,
            "fits_h200": plan.fits,
        }
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-27b", choices=["qwen3-8b", "qwen3.6-27b"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1 << 21)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument(
        "--backend", choices=["nccl", "gloo"], default=None, help="default: nccl (gloo with --tiny)"
    )
    ap.add_argument("--check-only", action="store_true", help="only the small-P exactness checks")
    ap.add_argument("--cycles", type=int, default=1, help="G-response replay cycles on the same prefix")
    ap.add_argument("--generate-every-cycle", action="store_true", help="sample new responses each cycle")
    ap.add_argument("--tag", default="", help="suffix of the JSON name")
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU (gloo) with tiny dimensions")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if not args.tiny:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    # every exit path leaves the process group (barrier + destroy; destroy alone on an exception)
    with process_group(args.backend or ("gloo" if args.tiny else "nccl")):
        run(args)


def run(args: argparse.Namespace) -> None:
    dev = "cpu" if args.tiny else "cuda"
    small_p = 3000 if args.tiny else 40000

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    torch.manual_seed(0)
    config = slice_config(
        args.preset, args.layers, max(args.prompt, small_p) + max(args.response, 512) + 16, args.tiny
    )
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    for p in model.parameters():  # identical weights on every rank
        dist.broadcast(p.data, src=0)
    model.train()

    # --- exactness at a small P: sharded vs single-rank state, gradients identical across ranks ---
    g = torch.Generator(device=dev).manual_seed(1)
    small = torch.randint(0, config.vocab_size, (small_p,), device=dev, generator=g)
    comp = torch.randint(0, config.vocab_size, (2, 512), device=dev, generator=g)
    single = capture_prompt(model, small, chunk_size=8192, page_size=4096)
    sharded = capture_prompt(model, small, chunk_size=8192, page_size=4096, cp_group=group)
    diff = (replay_logprobs(single, model, comp) - replay_logprobs(sharded, model, comp)).abs().max().item()
    model.zero_grad(set_to_none=True)
    replay_logprobs(sharded, model, comp[:1], grad=True).mean().backward()
    sums = grad_checksum(model)
    gathered = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(gathered, sums)
    grads_identical = all(torch.equal(gathered[0], s) for s in gathered)
    del single, sharded
    model.zero_grad(set_to_none=True)
    if not args.tiny:
        torch.cuda.empty_cache()

    if args.check_only:
        if rank == 0:
            payload = {
                "preset": args.preset,
                "layers": args.layers,
                "cp_size": world,
                "backend": dist.get_backend(),
                "ranks_per_gpu": world // max(1, torch.cuda.device_count()) if not args.tiny else None,
                "check_small_P": small_p,
                "check_max_abs_logprob_diff_sharded_vs_single": diff,
                "check_grads_identical_across_ranks": grads_identical,
            }
            path = write_result(f"cpcheck{world}_{args.preset}_{args.layers}L_{dist.get_backend()}", payload)
            print(
                f"check at P={small_p}: max |dlogp| sharded vs single = {diff:.3g}; grads identical: {grads_identical}"
            )
            print(f"wrote {path}")
        return

    # --- the long prompt ---
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), device=dev, generator=g)
    reset_peak()
    with Timer() as t_cap:
        state = capture_prompt(
            model, prompt, chunk_size=args.chunk, page_size=args.page, cp_group=group, progress=False
        )
    capture_peak = peak_gib()
    # G responses sampled from the shared state (every rank decodes the same tokens), then replayed with
    # backward one at a time; --cycles repeats the replays on the same prefix (refresh_policy="reuse"),
    # with the gradient buffers kept between cycles as an optimizer step would keep them
    reset_peak()
    with Timer() as t_gen:
        ids = generate_from_state(state, model, args.generations, args.response, eos_token_id=None)
    generation_peak = peak_gib()
    times, cycle_peaks = [], []
    for cycle in range(args.cycles):
        reset_peak()
        if cycle and args.generate_every_cycle:
            ids = generate_from_state(state, model, args.generations, args.response, eos_token_id=None)
        for i in range(args.generations):
            with Timer() as t:
                (-replay_logprobs(state, model, ids[i][None], grad=True).mean()).backward()
            times.append(t.seconds)
        model.zero_grad(set_to_none=False)
        cycle_peaks.append(peak_gib())
    replay_peak = max(cycle_peaks)
    per_rank = {
        "rank": rank,
        "state_bytes": state.nbytes(),
        "state_bytes_by_kind": state.nbytes_by_kind(),
        "capture_s": t_cap.seconds,
        "capture_peak_gib": capture_peak,
        "generation_s": t_gen.seconds,
        "generation_peak_gib": generation_peak,
        "replay_peak_gib_per_cycle": cycle_peaks,
        "replay_s_per_response": mean_after_first(times),
        "replay_s_first": times[0],
        "replay_peak_gib": replay_peak,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, per_rank)
    if rank == 0:
        payload = {
            "preset": args.preset,
            "model": f"{args.preset} layer dimensions, {args.layers} layers "
            f"({full_attention_layers(config)} full attention), random init, bf16, full fine-tuning",
            "layers": args.layers,
            "cp_size": world,
            "prompt_tokens": args.prompt,
            "response_tokens": args.response,
            "generations": args.generations,
            "cycles": args.cycles,
            "generate_every_cycle": args.generate_every_cycle,
            "chunk_size": args.chunk,
            "page_size": args.page,
            "check_small_P": small_p,
            "check_max_abs_logprob_diff_sharded_vs_single": diff,
            "check_grads_identical_across_ranks": grads_identical,
            "ranks": everyone,
            "planner_full_model": full_model_predictions(args, world),
        }
        path = write_result(f"cp{world}_{args.preset}_{args.layers}L_P{args.prompt}{args.tag}", payload)
        print(
            f"check at P={small_p}: max |dlogp| sharded vs single = {diff:.3g}; grads identical: {grads_identical}"
        )
        rows = [
            {
                "rank": r["rank"],
                "state GiB": f"{r['state_bytes'] / GiB:.2f}",
                "kinds MiB": " ".join(f"{k}={v / 2**20:.0f}" for k, v in r["state_bytes_by_kind"].items()),
                "capture s": f"{r['capture_s']:.1f}",
                "cap peak GiB": f"{r['capture_peak_gib']:.1f}",
                "gen s": f"{r['generation_s']:.1f}",
                "replay s/resp": f"{r['replay_s_per_response']:.2f}",
                "replay peak GiB": f"{r['replay_peak_gib']:.1f}",
            }
            for r in everyone
        ]
        print_table(rows)
        for name, plan in payload["planner_full_model"].items():
            print(f"planner, full model, {name}: peak {plan['peak_gib']:.1f} GiB per rank")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
