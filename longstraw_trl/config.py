"""`LongStrawGRPOConfig`: TRL's `GRPOConfig` plus the prompt-state and refresh options of LongStraw-TRL.

Plain data, as TRL's configs are: `__post_init__` validates and normalises the fields and nothing else. What needs
the model, the accelerator or the runtime is checked by the trainer (`longstraw_trl.checks`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .constants import (
    AUTO,
    AUTO_PREFERRED,
    DEFAULT_PAGE_SIZE,
    EP_IMPLEMENTATIONS,
    GRADIENT_MODES,
    KERNEL_CACHE_SUBDIR,
    OFFLOAD_CHOICES,
    REFRESH_POLICIES,
    GradientMode,
    PrefixSharing,
)
from .errors import LongStrawError

__all__ = ["LongStrawGRPOConfig", "check_train_groups", "check_whole_groups"]


def check_whole_groups(
    batch_size: int, num_generations: int, batch_name: str, generations_name: str, what: str = "micro-batch"
) -> None:
    """Raise unless a `what` of `batch_size` completions holds whole groups of `num_generations`."""
    if num_generations and batch_size % num_generations != 0:
        lower = max(num_generations * (batch_size // num_generations), num_generations)
        raise LongStrawError(
            f"LongStrawGRPOTrainer samples each prompt group from one captured prompt state, so every {what} of a "
            f"process must hold whole groups: {batch_name}={batch_size} is not a multiple of "
            f"{generations_name}={num_generations}. Set {batch_name} to a multiple of {num_generations} (e.g. {lower} "
            f"or {lower + num_generations}), or set {generations_name} to a divisor of {batch_size}."
        )


def check_train_groups(args: GRPOConfig) -> None:
    """A process's generation batch (`per_device_train_batch_size * steps_per_generation` completions) must hold
    whole groups; a micro-batch may hold part of one (its state is kept across the micro-batches)."""
    steps = args.steps_per_generation or args.gradient_accumulation_steps
    check_whole_groups(
        args.per_device_train_batch_size * steps,
        args.num_generations,
        f"per_device_train_batch_size * steps_per_generation ({args.per_device_train_batch_size} * {steps})",
        "num_generations",
        what="generation batch",
    )


@dataclass
class LongStrawGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`LongStrawGRPOTrainer`]: every field of TRL's [`~trl.GRPOConfig`] plus the options below.

    The trainer captures each prompt once (no autograd, in chunks) into a read-only prompt state, samples the
    `num_generations` completions of its group from that state, and computes the policy loss one response at a time
    on top of it. A process's generation batch must therefore hold whole groups: `per_device_train_batch_size *
    steps_per_generation` must be a multiple of `num_generations` (a micro-batch may hold part of a group, as in TRL:
    e.g. `per_device_train_batch_size=4, num_generations=8, gradient_accumulation_steps=2`), and when evaluating
    `per_device_eval_batch_size` a multiple of `num_generations_eval` (TRL generates each evaluation batch on its own).

    TRL's entropy options keep their meaning: `entropy_coef` (the bonus back-propagates differentiable entropies of
    the replay), `use_adaptive_entropy` with `entropy_target` / `entropy_coef_delta` / `entropy_coef_min` /
    `entropy_coef_max`, and `top_entropy_quantile` (each micro-batch is then first replayed once without autograd to
    compute the entropies its quantile is taken over; not with `cp_size > 1`).

    Parameters:
        > Prompt state

        capture_chunk_size (`int` or `"auto"`, *optional*, defaults to `"auto"`):
            Prompt tokens per prefill step of the capture (and, with `gradient_mode="full"`, of the prompt backward's
            recomputed segment). Peak activation memory of the capture grows with the chunk, never with the prompt
            length. `"auto"`: 8192 where the step fits with it, else the largest smaller power of two (down to 1024)
            with which the pre-flight plan fits (`docs/planner.md`); 8192 where no plan is made.
        page_size (`int`, *optional*, defaults to `16384`):
            Tokens per K/V page of the full-attention layers (pages are allocated one at a time as the prompt is
            captured and are never copied).
        offload_prompt_state (`str` or `None`, *optional*, defaults to `"auto"`):
            Where the K/V pages live: `None` keeps them on the model's device; `"cpu"` keeps them in pinned host memory
            and streams them to the device page by page during generation and replays (every decode step then reads
            the whole prompt state from the host: slower). `"auto"`: the pre-flight plan chooses at the first
            generation batch (`preflight_plan`): on the device where that plan fits the GPU memory with a margin,
            else in host memory where that plan fits, else the trainer refuses before any capture, naming the
            changes that would fit. Without a GPU (and no `preflight_gpu_memory_bytes`), or with
            `preflight_plan=False`, `"auto"` keeps the state on the device.
        offload_keep_layers_on_device (`bool`, *optional*, defaults to `True`):
            With the prompt state in host memory (`offload_prompt_state="cpu"`, or `"auto"` choosing it), the
            response-only gradient and a pre-flight plan: whole layers of the offloadable state (K/V pages, MLA latent) stay on the device, in layer
            order, within 90% of the GPU memory the plan leaves free (the plan counts them; the trainer's log line
            says how much); only the other layers stream from host memory at every decode step and replay. `False`:
            every layer streams. Without a pre-flight plan (`preflight_plan=False`, or no GPU and no
            `preflight_gpu_memory_bytes`) every layer streams.
        preflight_plan (`bool`, *optional*, defaults to `True`):
            Plan the step's memory (`longstraw plan`'s planner, with the real prompt length, `max_completion_length`,
            `num_generations` and the GPU memory free at that moment) at the first generation batch, and again
            whenever a batch holds more prompt tokens or generations than planned, before any capture: it resolves
            `offload_prompt_state="auto"` and refuses (`PreflightError`, with the planner's table and the changes
            that would fit) a step that does not fit, whatever `offload_prompt_state` says. The choice is logged.
            Set `False` to skip it (`"auto"` then keeps the state on the device). Made only on a GPU, or with
            `preflight_gpu_memory_bytes`.
        preflight_gpu_memory_bytes (`int` or `None`, *optional*, defaults to `None`):
            GPU memory (bytes) the pre-flight plan may use for the whole step, weights included. `None`: what the
            device reports free plus what this process already holds, less 5% of the card.
        replay_batch_tokens (`int` or `"auto"`, *optional*, defaults to `"auto"`):
            Responses of one prompt group are replayed together under autograd (one forward and one backward for
            the batch) while the batch's padded tokens (responses x the longest) stay within this budget; the
            gradient is the same as one response at a time. A replay of one short response is bound by the host
            (measured on the whole Qwen3.6-27B at P = 65,536, R = 256: 1.81 s for one response, 0.28 s per
            response for eight together), so batching divides its cost; the autograd graph grows with the budget
            (`longstraw plan --replay-batch-tokens`). `0` replays one response at a time. `"auto"`: 8192 where the
            step fits with it, else 4096, 2048 or 0, the first with which the pre-flight plan fits; 8192 where no plan
            is made.
        replay_checkpoint_layers (`bool`, *optional*, defaults to `False`):
            Recompute every decoder layer of a response replay in backward instead of storing its activations (only
            where TRL's own gradient checkpointing, on by default, does not already checkpoint the layer).
        prompt_backward_checkpoint_layers (`bool` or `None`, *optional*, defaults to `None`):
            `gradient_mode="full"`: whether the prompt backward's recomputed capture chunk recomputes each decoder
            layer once more in its backward (checkpointing) instead of keeping every layer's activations over the
            chunk. `None`: as TRL's `gradient_checkpointing` (on by default) says, and on where the pre-flight plan
            fits the step only with it. `False` saves that second forward
            of every layer (the 8-layer Qwen3.6-27B slice's prompt backward at 262K: 21.3 s instead of 28.6 s on an
            H200) at the memory of every layer's graph over one chunk, which grows with
            `capture_chunk_size` (`longstraw plan --gradient-mode full --no-prompt-backward-checkpointing`): a
            smaller chunk, or a smaller model, makes room for it.

        gradient_mode (`str` or [`GradientMode`], *optional*, defaults to `"response_only"`):
            Which gradient a training step back-propagates (normalised to a [`GradientMode`]). `"response_only"`
            (or `"response"`): the prompt state is a constant, so
            gradients reach the weights through the last prompt token and the responses only (docs/design.md,
            "Objective"). `"full"`: TRL's full-sequence gradient (the prompt's tokens too): the replays also
            accumulate the gradient of the prompt state (fp32 buffers the size of its K/V, and the GDN states), then
            the prompt's capture chunks are recomputed under autograd in reverse order, one chunk's graph at a time.
            The capture keeps every GDN layer's state at each chunk boundary (per boundary: the model's GDN state
            bytes, e.g. 144 MiB for Qwen3.6-27B; sliding-window layers: their window's K/V). Needs
            `refresh_policy="recapture"` (a stale state has no exact gradient) and no fp16 loss scaling.
        replay_block_size (`int` or `None`, *optional*, defaults to `None`):
            Reverse block replay: replay each response in blocks of this many tokens, forward without autograd
            block by block keeping only the state at block boundaries (the response's K/V so far, the GDN states),
            then recompute the blocks under autograd in reverse order, carrying each block's gradient back to the
            earlier ones. Peak memory is one block's graph plus the response's state, whatever the response length;
            the gradient is the same (each block back-propagates the response's loss through its own tokens, the
            other blocks' log-probs held at their values). `None` (the default): each response is replayed whole.

        cp_size (`int`, *optional*, defaults to `1`):
            Context-parallel ranks per prompt: consecutive groups of `cp_size` processes share each prompt, every rank
            holding 1/`cp_size` of its K/V pages (GDN state, weights and responses are replicated). The rank-0 batch
            of each group is broadcast to the others; the world size must be a multiple of `cp_size`, and the
            remaining factor is data parallel. Not TRL's `cp_size`, which `GRPOConfig` rejects for GRPO.
        ep_size (`int`, *optional*, defaults to `1`):
            Expert-parallel ranks: the routed experts of every MoE layer are split over groups of `ep_size`
            consecutive ranks with transformers' expert parallelism (the config's `base_model_ep_plan`; `qwen3_moe`,
            `qwen3_5_moe`, `glm4_moe`, `glm_moe_dsa`, `gpt_oss`). An EP group lies inside a context-parallel group
            (`ep_size` must divide `cp_size`): its ranks hold the same batch, in step, which transformers'
            `"all_reduce"` implementation needs. The routers, attention and dense weights stay replicated. Expert
            gradients are averaged over the expert's replicas in the other EP groups, dense ones by DDP or FSDP2
            (Accelerate's FSDP2 plugin shards the dense weights; the experts are left out of `fully_shard`:
            docs/parallelism.md). The model's weights must be equal on every rank when the trainer is built.
        ep_implementation (`str`, *optional*, defaults to `"all_reduce"`):
            transformers' `ep_implementation` for `ep_size > 1`: `"all_reduce"` (every rank runs its own experts on
            all tokens and an all-reduce sums the outputs; no host sync, decode steps stay CUDA graphs) or
            `"all_to_all"` (the shared batch is sliced over the group, tokens are exchanged with all-to-all; the split
            sizes are read on the host every MoE layer).

        > Refresh of stale prompt states

        refresh_policy (`str`, *optional*, defaults to `"recapture"`):
            What to do with a captured prompt state once an optimizer step has made it stale (it was computed with
            older weights) and it is needed again, either by a later optimizer step on the same generation batch
            (`num_iterations > 1`, or `steps_per_generation > gradient_accumulation_steps`) or because the same prompt
            recurs in a later generation batch:

            - `"recapture"`: always re-prefill the prompt with the current weights (on-policy; the gradient is exactly
              the response-only gradient of TRL's loss);
            - `"reuse"`: keep using the state for up to `refresh_interval` optimizer steps after its capture, then
              re-prefill;
            - `"adaptive"`: like `"reuse"`, but every `refresh_probe_period`-th stale use re-prefills and measures the
              drift, the mean absolute difference of a probe response's token log-probs between the stale and the
              fresh state; above `refresh_drift_threshold` the interval is halved, otherwise it grows by one (up to
              `refresh_max_interval`).
        refresh_interval (`int`, *optional*, defaults to `1`):
            For `"reuse"`: how many optimizer steps after its capture a state may still be used. For `"adaptive"`: the
            starting interval. `0` makes both behave like `"recapture"`.
        refresh_drift_threshold (`float`, *optional*, defaults to `0.02`):
            For `"adaptive"`: the mean absolute log-prob difference (nats per response token) above which the interval
            is narrowed.
        prompt_cache_gib (`float` or `None`, *optional*, defaults to `4.0`):
            GiB of prompt states kept between batches beyond the ones the current batch uses (`None`: no limit). A
            prompt whose prefix is cached (an agent's history grown by some turns) is extended from it instead of
            captured again; the least recently used states go first. The planner does not count these bytes: set 0
            when a plan is at the edge of the device's memory.
        prompt_prefix_sharing (`str`, `bool` or [`PrefixSharing`], *optional*, defaults to `"batch"`):
            Which common prefixes of prompts are captured once when neither prompt is a whole prefix of the other (two
            decision points of one trajectory whose last turn renders differently, sibling prompts of one history);
            a prompt that extends a whole cached prompt reuses its state whatever this says. Normalised to a
            [`PrefixSharing`]:

            - `"batch"`: a generation batch's prompts through their prompt trie: each trunk (a common prefix at
              which the batch's prompts branch) is captured once as a prompt of its own, and the prompts extend it
              (its K/V pages shared by the branches, no copy). A trunk ends where its branches part, so nothing is
              kept at capture-chunk boundaries; a trunk holds one prompt's fixed-size layer states (GDN, sliding
              windows) of its own while the batch uses it.
            - `"all"` (or `True`): as `"batch"`, and a later prompt also branches off any cached state it shares a
              prefix with. Policy captures then keep the fixed-size layers' states at every capture-chunk boundary,
              so a prompt that branches inside a chunk re-prefills at most that chunk (per boundary: the model's GDN
              state bytes, e.g. 144 MiB for Qwen3.6-27B, counted in `prompt_cache_gib`; `longstraw plan
              --prefix-sharing all` adds them): about 9 GiB on the device for the whole Qwen3.6-27B at 512K with 8K
              chunks, 18 GiB at 1M (they stay on the device with `offload_prompt_state="cpu"`), which the 1M step on
              one H200 has no room for. For agent trajectories whose decision points arrive in different batches; on
              models without GDN or window layers the kept states cost nothing.
            - `"off"` (or `False`): no trunks; only whole cached prompts are extended.

            A common prefix shorter than `capture_chunk_size` is not shared (a chat template's system turn). With
            `gradient_mode="full"` the boundaries are kept whatever this says.
        graph_free_adapters_in_model_dtype (`bool`, *optional*, defaults to `True`):
            During the capture and generation (no autograd), run PEFT adapter weights (which PEFT keeps in fp32 beside a
            bf16 model) in the model's dtype: the fp32 GEMMs and casts of every adapted layer go (about a quarter of a
            whole-model capture with LoRA on every linear layer). The adapter's contribution is rounded to bf16 before
            it is added to the bf16 layer output. Replays (training, old and reference log-probs) always run the
            adapters as PEFT does. No effect without adapters or on fp32 models.
        graph_free_fused_kernels (`bool`, *optional*, defaults to `True`):
            During the capture, generation and prompt extension (no autograd, CUDA), run Hugging Face's RMSNorm,
            gated RMSNorm and SiLU-MLP modules of the known classes as one fused Triton kernel each
            (`longstraw_trl.fused_elementwise_forwards`) instead of their chains of small kernels. HF's cast points
            are kept: outputs match HF's to within one unit in the last place of the model's dtype (the fp32
            summation order of the norm's mean). Replays (training, old and reference log-probs) run what
            `autograd_fused_kernels` says. No effect on the CPU or without Triton.
        autograd_fused_kernels (`bool`, *optional*, defaults to `True`):
            During the policy replays and, with `gradient_mode="full"`, the prompt backward's recomputed segments (under
            autograd, CUDA), run the same modules as `graph_free_fused_kernels` through fused Triton kernels that have
            their own Triton backward (`fused_elementwise_forwards(..., differentiable=True)`) instead of HF's chains
            of small fp32 kernels and their autograd backward (a fifth of a 27B prompt-backward segment's device time
            on an H100 went to such elementwise kernels and copies; the segment's prompt backward took 57.6 s instead
            of 64.2 at 64K). Forward outputs as `graph_free_fused_kernels`'; gradients equal autograd's through HF's
            modules up to fp32 summation order. Plain PEFT LoRA layers also add their update in the base GEMM's
            epilogue (`torch.addmm`, the scale on the `[T, r]` operand) instead of PEFT's multiply and add over the
            layer's output (on the CPU too; not yet timed on the GPU). The graph-free scoring passes (old and
            reference log-probs, entropies) run the same forwards, so that the old log-probs equal the first replay's
            bit for bit, as in stock TRL.
        generation_fsdp_gather_gib (`float` or `None`, *optional*, defaults to `None`):
            Under FSDP2, GPU memory (GiB) the generation may spend keeping the model's FSDP2 units gathered from their
            first decode step to the last: FSDP2 otherwise gathers every layer for every generated token (R
            all-gathers of the whole model; at world size 1 on torch 2.11 a copy of it, which made the 27B's
            generation 2.3x the unwrapped model's on an H100). Units are kept in module order while the budget
            lasts; where units are left to gather per token, the decode steps run eagerly (no CUDA graph). `None`:
            what the GPU can still give less 2 GiB and 5% of the card; `0`: gather per token. No effect without
            FSDP2.
        kernel_cache_dir (`str` or `None`, *optional*, defaults to `"auto"`):
            Where Triton keeps the compiled GPU kernels and its autotuning choices (ours and fla's). A fresh process
            on an empty cache compiles and autotunes them during its first step: on the whole Qwen3.6-27B at 32K
            that step took 105 s against 6 s warm, and 8.5 s in a new process that found the cache again
            (`bench/results/cold_start_qwen3.6-27b_h200_P32768.json`). `"auto"`:
            `<output_dir>/_longstraw_kernel_cache`, so a job restarted in a fresh container that keeps its output
            directory (e.g. to resume) skips that (the leading underscore keeps it out of `push_to_hub` uploads); a
            path: that directory; `None`: Triton's default (`~/.triton/cache`). A `TRITON_CACHE_DIR` set in the
            environment always wins.
        compile_ahead (`bool`, *optional*, defaults to `True`):
            On a GPU with a compile manifest for it (`kernels/runtime/compile_manifest/<GPU>.json`, same Triton and fla
            versions), compile the Triton kernel specialisations a step uses in worker processes from the moment the
            trainer is created (so it overlaps with its set-up), instead of one after another inside the first step;
            the step waits only for a kernel still being compiled. `start_compile_ahead_here(args.kernel_cache_dir)`
            of `longstraw_trl.kernels.runtime.compile_ahead` starts it earlier (e.g. before loading the model); the
            trainer then finds it started. Only the first process of each machine compiles (the others find its
            binaries in the shared `kernel_cache_dir`); its workers hold a CUDA context each for those seconds.
            `LONGSTRAW_DISABLE=compile_ahead` turns it off too.
        refresh_probe_period (`int`, *optional*, defaults to `4`):
            For `"adaptive"`: measure the drift on every k-th stale use of a state.
        refresh_max_interval (`int`, *optional*, defaults to `16`):
            For `"adaptive"`: upper bound of the interval.
    """

    capture_chunk_size: str = field(
        default=AUTO,
        metadata={
            "help": "Prompt tokens per prefill step of the capture, or 'auto' (8192 where the pre-flight plan fits "
            "it, else the largest smaller power of two that fits). Peak activation memory of the capture grows with "
            "the chunk, never with the prompt length."
        },
    )
    page_size: int = field(
        default=DEFAULT_PAGE_SIZE,
        metadata={"help": "Tokens per K/V page of the full-attention layers of the captured prompt state."},
    )
    offload_prompt_state: str | None = field(
        default="auto",
        metadata={
            "help": "Where the K/V pages of the prompt state live: 'auto' (the pre-flight plan chooses: the device "
            "where the step fits, else host memory), None (the model's device) or 'cpu' (pinned host memory, "
            "streamed to the device page by page).",
            "choices": ["auto", "cpu"],
        },
    )
    offload_keep_layers_on_device: bool = field(
        default=True,
        metadata={
            "help": "With the prompt state in host memory and a pre-flight plan: keep whole layers of it on the "
            "device within 90% of the GPU memory the plan leaves free; only the other layers stream."
        },
    )
    preflight_plan: bool = field(
        default=True,
        metadata={
            "help": "Plan the step's memory at the first generation batch (and when prompts or generations grow), "
            "before any capture: resolve offload_prompt_state='auto', refuse a step that does not fit."
        },
    )
    preflight_gpu_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "GPU memory (bytes) the pre-flight plan may use for the whole step; default: what the device "
            "reports free plus what this process holds, less 5% of the card."
        },
    )
    prompt_cache_gib: float | None = field(
        default=4.0,
        metadata={
            "help": "GiB of prompt states kept between batches beyond the current batch's (None: no limit). Prompts "
            "whose prefix is cached are extended from it instead of captured again."
        },
    )
    prompt_prefix_sharing: str = field(
        default=PrefixSharing.BATCH.value,
        metadata={
            "help": "Which common prefixes of prompts are captured once: 'batch' (the trunks at which a generation "
            "batch's prompts branch), 'all' (also branches off any cached state: the GDN / window states are kept at "
            "every capture-chunk boundary for it; True means 'all') or 'off' (False: whole cached prompts only)."
        },
    )
    graph_free_adapters_in_model_dtype: bool = field(
        default=True,
        metadata={
            "help": "During capture and generation (no autograd), run PEFT adapters (fp32 by PEFT's default) in the "
            "model's dtype. Replays always run them as PEFT does."
        },
    )
    graph_free_fused_kernels: bool = field(
        default=True,
        metadata={
            "help": "During capture, generation and extension (no autograd, CUDA), run HF's RMSNorm, gated RMSNorm "
            "and SiLU-MLP modules as fused Triton kernels (HF's cast points kept). Replays and scoring passes: see "
            "autograd_fused_kernels."
        },
    )
    autograd_fused_kernels: bool = field(
        default=True,
        metadata={
            "help": "During the replays and the full mode's prompt backward (autograd), run HF's RMSNorm, gated "
            "RMSNorm and SiLU-MLP modules as fused Triton kernels with a Triton backward (CUDA), and plain LoRA "
            "layers' update in the base GEMM's epilogue."
        },
    )
    generation_fsdp_gather_gib: float | None = field(
        default=None,
        metadata={
            "help": "Under FSDP2: GPU memory (GiB) the generation may spend keeping FSDP2 units gathered across decode "
            "steps instead of gathering every layer per token (None: what the GPU can still give, less a margin; "
            "0: per token)."
        },
    )
    kernel_cache_dir: str | None = field(
        default="auto",
        metadata={
            "help": "Triton's cache of compiled kernels and autotuning choices: 'auto' (<output_dir>/"
            "_longstraw_kernel_cache: a restarted job skips the ~100 s of compilation of a cold first step), a "
            "directory, or None (Triton's default). TRITON_CACHE_DIR in the environment wins."
        },
    )
    compile_ahead: bool = field(
        default=True,
        metadata={
            "help": "Compile this GPU's recorded Triton kernel specialisations (kernels/runtime/compile_manifest) in worker "
            "processes while the trainer sets up, rather than one by one inside the first step."
        },
    )
    replay_batch_tokens: str = field(
        default=AUTO,
        metadata={
            "help": "Replay the responses of one prompt group together under autograd while responses x longest "
            "stays within this many tokens (same gradient; fewer, larger kernels). 0: one response at a time. "
            "'auto': 8192 where the pre-flight plan fits it, else less."
        },
    )
    replay_checkpoint_layers: bool = field(
        default=False,
        metadata={
            "help": "Recompute every decoder layer of a response replay in backward instead of storing its "
            "activations (where TRL's gradient checkpointing does not already checkpoint it)."
        },
    )
    prompt_backward_checkpoint_layers: bool | None = field(
        default=None,
        metadata={
            "help": "gradient_mode='full': checkpoint the layers of the prompt backward's recomputed chunk (None: as "
            "gradient_checkpointing says, or on where the pre-flight plan fits only so; False: keep every layer's "
            "activations over a chunk, one forward less)."
        },
    )
    gradient_mode: str = field(
        default=GradientMode.RESPONSE.value,
        metadata={
            "help": "'response_only' (the prompt state is a constant) or 'full' (TRL's full-sequence gradient: the "
            "prompt's chunks are recomputed under autograd in reverse order after the replays).",
            "choices": list(GRADIENT_MODES),
        },
    )
    replay_block_size: int | None = field(
        default=None,
        metadata={
            "help": "Replay each response in blocks of this many tokens, recomputed under autograd in reverse order "
            "(peak memory: one block's graph). None: whole responses."
        },
    )
    cp_size: int = field(
        default=1,
        metadata={
            "help": "Context-parallel ranks per prompt (its K/V pages are spread over them); the world size must be "
            "a multiple of it."
        },
    )
    ep_size: int = field(
        default=1,
        metadata={
            "help": "Expert-parallel ranks (transformers' EP over consecutive ranks inside a context-parallel group; "
            "must divide cp_size)."
        },
    )
    ep_implementation: str = field(
        default="all_reduce",
        metadata={
            "help": "transformers' ep_implementation for ep_size > 1: 'all_reduce' or 'all_to_all'.",
            "choices": list(EP_IMPLEMENTATIONS),
        },
    )
    refresh_policy: str = field(
        default="recapture",
        metadata={
            "help": "What to do with a prompt state made stale by an optimizer step: 'recapture' (always re-prefill), "
            "'reuse' (keep it for up to `refresh_interval` optimizer steps) or 'adaptive' (measure the log-prob "
            "drift every `refresh_probe_period` stale uses and adapt the interval against "
            "`refresh_drift_threshold`).",
            "choices": list(REFRESH_POLICIES),
        },
    )
    refresh_interval: int = field(
        default=1,
        metadata={
            "help": "'reuse': optimizer steps after its capture during which a state may still be used; 'adaptive': "
            "the starting interval. 0 means always re-prefill."
        },
    )
    refresh_drift_threshold: float = field(
        default=0.02,
        metadata={
            "help": "'adaptive': mean absolute token log-prob difference (nats) between a stale and a fresh state "
            "above which the reuse interval is halved (otherwise it grows by one)."
        },
    )
    refresh_probe_period: int = field(
        default=4,
        metadata={"help": "'adaptive': measure the drift on every k-th stale use of a prompt state."},
    )
    refresh_max_interval: int = field(
        default=16,
        metadata={"help": "'adaptive': upper bound of the reuse interval."},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of `activation_checkpointing` (transformers 5.23). Left unset, "
            "`activation_checkpointing` defaults to True, as TRL's `gradient_checkpointing` does, without the "
            "deprecation warning TRL's default triggers."
        },
    )

    def __post_init__(self):
        if self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default, under the name transformers 5.23 keeps
        super().__post_init__()
        check_train_groups(self)  # after GRPOConfig has derived steps_per_generation
        self._normalise()
        self._check_prompt_state()
        self._check_gradient_mode()
        self._check_parallelism()
        self._check_refresh()
        if self.do_eval and self.eval_strategy != "no":
            check_whole_groups(
                self.per_device_eval_batch_size,
                self.num_generations_eval or self.num_generations,
                "per_device_eval_batch_size",
                "num_generations_eval" if self.num_generations_eval else "num_generations",
            )

    def _normalise(self) -> None:
        """The spellings of "none" become `None`, `gradient_mode` a [`GradientMode`], `prompt_prefix_sharing` a
        [`PrefixSharing`] (`True`: `"all"`, `False`: `"off"`), `kernel_cache_dir="auto"` a folder of `output_dir`."""
        if self.offload_prompt_state in ("none", "None", ""):
            self.offload_prompt_state = None
        for name in AUTO_PREFERRED:  # a number from the command line, "auto", or an int
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().lower() != AUTO:
                try:
                    setattr(self, name, int(value))
                except ValueError:
                    raise LongStrawError(f"{name} must be an int or 'auto', got {value!r}.") from None
            elif isinstance(value, str):
                setattr(self, name, AUTO)
        if self.kernel_cache_dir in ("none", "None", ""):
            self.kernel_cache_dir = None
        if self.kernel_cache_dir == "auto":
            self.kernel_cache_dir = os.path.join(self.output_dir, KERNEL_CACHE_SUBDIR)
        try:
            self.gradient_mode = GradientMode.parse(self.gradient_mode)
            self.prompt_prefix_sharing = PrefixSharing.parse(self.prompt_prefix_sharing)
        except ValueError as error:
            raise LongStrawError(str(error)) from None

    def _check_prompt_state(self) -> None:
        if self.offload_prompt_state not in OFFLOAD_CHOICES:
            raise LongStrawError(
                f"offload_prompt_state must be None or 'cpu', or 'auto' (the pre-flight plan chooses), got "
                f"{self.offload_prompt_state!r}."
            )
        if self.preflight_gpu_memory_bytes is not None and not self.preflight_gpu_memory_bytes > 0:
            raise LongStrawError(
                f"preflight_gpu_memory_bytes must be None or > 0 bytes, got {self.preflight_gpu_memory_bytes!r}."
            )
        if self.generation_fsdp_gather_gib is not None and not self.generation_fsdp_gather_gib >= 0:
            raise LongStrawError(
                f"generation_fsdp_gather_gib must be None or >= 0 GiB, got {self.generation_fsdp_gather_gib!r}."
            )
        if self.capture_chunk_size != AUTO and self.capture_chunk_size <= 0 or self.page_size <= 0:
            raise LongStrawError(
                f"capture_chunk_size (or 'auto') and page_size must be positive, got {self.capture_chunk_size!r} and "
                f"{self.page_size}."
            )
        if self.replay_block_size is not None and self.replay_block_size <= 0:
            raise LongStrawError(f"replay_block_size must be positive or None, got {self.replay_block_size}.")
        if self.replay_batch_tokens != AUTO and self.replay_batch_tokens < 0:
            raise LongStrawError(
                f"replay_batch_tokens must be >= 0 (0: one response at a time), got {self.replay_batch_tokens}."
            )

    def _check_gradient_mode(self) -> None:
        if self.gradient_mode.full and self.refresh_policy != "recapture":
            raise LongStrawError(
                f"gradient_mode='full' with refresh_policy={self.refresh_policy!r} is not supported: a prompt state "
                "captured with older weights has no exact full gradient. Set refresh_policy='recapture'."
            )
        if self.gradient_mode.full and self.fp16:
            raise LongStrawError(
                "gradient_mode='full' with fp16=True is not supported (the prompt backward runs outside the "
                "accelerator's loss scaling). Use bf16=True."
            )

    def _check_parallelism(self) -> None:
        if self.cp_size < 1:
            raise LongStrawError(f"cp_size must be >= 1, got {self.cp_size}.")
        if self.ep_size < 1:
            raise LongStrawError(f"ep_size must be >= 1, got {self.ep_size}.")
        if self.ep_size > 1 and self.cp_size % self.ep_size:
            raise LongStrawError(
                f"ep_size={self.ep_size} must divide cp_size={self.cp_size}: an expert-parallel group must hold one "
                "batch, in step (the ranks of a context-parallel group run every prompt chunk, decode step and replay "
                "together; data-parallel ranks do not, and a per-layer expert exchange between them would deadlock). "
                f"Set cp_size to a multiple of {self.ep_size} (e.g. cp_size={self.ep_size})."
            )
        if self.ep_implementation not in EP_IMPLEMENTATIONS:
            raise LongStrawError(
                f"ep_implementation must be one of {', '.join(EP_IMPLEMENTATIONS)}, got {self.ep_implementation!r}."
            )
        if self.cp_size > 1 and self.scale_rewards == "batch":
            raise LongStrawError(
                "scale_rewards='batch' with cp_size > 1 is not supported: the rewards gathered over ranks hold each "
                "group cp_size times, which changes the batch std. Use scale_rewards='group' or 'none'."
            )

    def _check_refresh(self) -> None:
        if self.refresh_policy not in REFRESH_POLICIES:
            raise LongStrawError(
                f"refresh_policy must be one of {', '.join(REFRESH_POLICIES)}, got {self.refresh_policy!r}."
            )
        if self.refresh_interval < 0 or self.refresh_max_interval < 0:
            raise LongStrawError("refresh_interval and refresh_max_interval must be >= 0.")
        if self.refresh_probe_period < 1:
            raise LongStrawError(f"refresh_probe_period must be >= 1, got {self.refresh_probe_period}.")
        if self.refresh_drift_threshold < 0:
            raise LongStrawError(f"refresh_drift_threshold must be >= 0, got {self.refresh_drift_threshold}.")
