"""Where a replay + backward (or a capture) spends its time: the whole model (or a slice), LoRA, profiled.

Builds the preset with random bf16 weights on the GPU, LoRA on every linear layer, HF gradient
checkpointing on (TRL's default), captures a random prompt, then times ``replay_logprobs(state, ..., grad=True)`` +
``backward`` of one random response (warm) and prints the CUDA ops that take the most time. With
``--phase capture`` it profiles the capture itself instead (warm: a first capture runs before), and
reports its GPU-busy time beside its wall time.

    python bench/profile_replay.py --prompt 32768 --response 256
    python bench/profile_replay.py --phase capture --prompt 65536
    python bench/profile_replay.py --phase both --prompt 131072   # replay, then capture, one model build
    python bench/profile_replay.py --phase replay decode --batches 8 --layers 16 --prompt 524288
    python bench/profile_replay.py --glm-slice --prompt 65536 --phase replay capture   # GLM-5, 1 dense + 2 MoE

``--phase decode`` profiles ``--decode-steps`` decode steps of ``--generations`` sequences (the trainer's
generation path: one CUDA graph per step) and reports milliseconds per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
from common import Timer, write_result
from peft import LoraConfig, get_peft_model
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt, fused_elementwise_forwards, generate_from_state, replay_logprobs
from longstraw_trl.adapters import adapters_in_model_dtype
from longstraw_trl.presets import preset_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--phase", nargs="+", choices=("replay", "capture", "decode", "both"), default=["replay"])
    ap.add_argument("--generations", type=int, default=8, help="sequences decoded together (decode)")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps timed and profiled")
    ap.add_argument(
        "--no-autocast",
        action="store_true",
        help="run without bf16 autocast (the trainer runs under accelerate's, so by default this does too)",
    )
    ap.add_argument("--chunk", type=int, default=16384, help="capture chunk size")
    ap.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1],
        help="responses replayed together under autograd (one backward for all); the first is profiled",
    )
    ap.add_argument(
        "--offload", action="store_true", help='the prompt state in host memory (offload_prompt_state="cpu")'
    )
    ap.add_argument(
        "--glm-slice",
        action="store_true",
        help="the GLM-5 slice of bench/glm_slice.py (layer 0 dense, the rest MoE; indexer full, then shared)",
    )
    args = ap.parse_args()
    # positions for the prompt and the response (the preset keeps the model's own 32K limit)
    positions = max(32768, args.prompt + args.response)
    if args.glm_slice:
        from glm_slice import slice_config

        layers = args.layers or 3
        config = slice_config(layers, ["full"] + ["shared"] * (layers - 1), positions, smoke=False)
    else:
        config = preset_config(args.preset, args.layers, max_position_embeddings=positions)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    prompt = torch.randint(0, config.vocab_size, (args.prompt,), device="cuda")
    completions = {
        k: torch.randint(0, config.vocab_size, (k, args.response), device="cuda") for k in args.batches
    }
    completion = completions[args.batches[0]]

    def autocast():
        return (
            torch.autocast("cuda", dtype=torch.bfloat16) if not args.no_autocast else contextlib.nullcontext()
        )

    @contextlib.contextmanager
    def graph_free():
        """What the trainer enters for capture and generation (`graph_free(model, cast_adapters=True)`): no
        autograd, autocast, adapters in the model's dtype with fused LoRA epilogues, fused elementwise kernels."""
        with torch.no_grad(), autocast(), adapters_in_model_dtype(model), fused_elementwise_forwards(model):
            yield

    offload = "cpu" if args.offload else None
    with Timer() as t_cap, graph_free():
        state = capture_prompt(
            model, prompt, chunk_size=args.chunk, progress=False, offload_prompt_state=offload
        )

    def run(phase: str) -> None:
        if phase == "capture":
            with graph_free():
                capture_prompt(
                    model, prompt, chunk_size=args.chunk, progress=False, offload_prompt_state=offload
                )
            return
        if phase == "decode":
            with graph_free():
                generate_from_state(
                    state, model, args.generations, args.decode_steps, do_sample=True, eos_token_id=None
                )
            return
        with autocast():
            (-replay_logprobs(state, model, completion, grad=True).mean()).backward()

    def replay_batches(batches: dict) -> dict:
        """Seconds per response of a replay + backward of ``k`` responses together (warm, best of 3)."""
        per_response = {}
        for k, ids in batches.items():
            with autocast():
                (-replay_logprobs(state, model, ids, grad=True).mean()).backward()  # warm this shape
            best = float("inf")
            for _ in range(3):
                with Timer() as t, autocast():
                    (-replay_logprobs(state, model, ids, grad=True).mean()).backward()
                best = min(best, t.seconds)
            per_response[k] = best / k
            print(f"replay + backward of {k} responses together: {best:.3f} s, {best / k:.3f} s per response")
        return per_response

    phases = [x for p in args.phase for x in (("replay", "capture") if p == "both" else (p,))]
    out = os.environ.get("OUT", ".")
    results: dict = {"first_capture_s": t_cap.seconds, "autocast": not args.no_autocast}
    for phase in phases:
        for _ in range(0 if phase == "capture" else 2):
            run(phase)
        times = []
        for _ in range(3 if phase == "replay" else 1):
            with Timer() as t:
                run(phase)
            times.append(t.seconds)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(phase)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60)
        # kernels only: CPU-side ops report their children's device time too, and the profiler's own
        # "Command Buffer Full" entries overlap the kernels they wait for
        kernels = [e for e in averages if e.device_type == DeviceType.CUDA and "Command Buffer" not in e.key]
        cuda_s = sum(e.self_device_time_total for e in kernels) / 1e6
        calls = sum(e.count for e in averages if e.key.startswith("aten::"))
        print(f"first capture {t_cap.seconds:.1f} s; {phase} (warm): {[round(x, 3) for x in times]} s")
        print(f"profiled {phase}: {cuda_s:.3f} s of CUDA kernels, {calls} aten calls")
        print(table)
        # host-side view too: a phase far above its floor with few kernel seconds waits on the host
        cpu_table = averages.table(
            sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60
        )
        with open(os.path.join(out, f"profile_{phase}{'_offload' if args.offload else ''}.txt"), "w") as f:
            f.write(table + "\n\nsorted by self CPU time:\n" + cpu_table)
        results[phase] = {"seconds": times, "profiled_cuda_kernel_s": cuda_s, "profiled_aten_calls": calls}
        if phase == "decode":
            # steady state: a call's first step runs eagerly and captures the graph, so per step is the
            # difference between a call of 2N steps and one of N
            with Timer() as t2:
                generate_from_state(
                    state, model, args.generations, 2 * args.decode_steps, do_sample=True, eos_token_id=None
                )
            results[phase]["ms_per_step"] = 1e3 * (t2.seconds - min(times)) / args.decode_steps
            results[phase]["generations"] = args.generations
            print(f"decode: {results[phase]['ms_per_step']:.2f} ms per step of {args.generations} sequences")
        if phase == "replay":
            results["replay_seconds_per_response"] = replay_batches(completions)
    write_result(
        f"profile_{'_'.join(args.phase)}_{'glm-5_slice' if args.glm_slice else args.preset}"
        + ("_offload" if args.offload else ""),
        {
            "prompt_tokens": args.prompt,
            "response_tokens": args.response,
            "capture_chunk_size": args.chunk,
            "layers": config.num_hidden_layers,
            **results,
        },
    )
    print(json.dumps({k: v for k, v in results.items()}))


if __name__ == "__main__":
    main()
