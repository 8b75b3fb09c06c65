"""`LongStrawGRPOTrainer`: TRL's `GRPOTrainer` with the prompt captured once per group and the loss streamed per response.

What changes compared to `GRPOTrainer` (TRL 1.16), and what does not
--------------------------------------------------------------------
TRL runs every one of the `G` sequences `prompt + completion` through the model, with autograd for the loss. Here
each group (one prompt, `G = num_generations` completions) goes through:

1. **capture**: the prompt is prefilled once, without autograd, into a read-only
   [`~longstraw_trl.PromptState`] (every capture goes through [`LongStrawGRPOTrainer._capture`]);
2. **generation**: the `G` completions are sampled together from that state (`PromptState.generate`), with TRL's
   sampling settings, EOS ids and padding;
3. **rewards and advantages**: TRL's own code, unchanged. The trainer overrides only the hooks TRL's
   `_generate_and_score_completions` calls for the model work: `_tokenize_prompts` (one tokenization per group),
   `_generate_single_turn` (steps 1-2) and `_get_per_token_logps_and_entropies` (old-policy and reference log-probs
   as graph-free replays on the captured states; the reference has its own capture, with the separate `ref_model` or
   with the PEFT adapters disabled). Reward functions, `_calculate_rewards`, `scale_rewards`,
   `multi_objective_aggregation`, `mask_truncated_completions`, the old-log-prob condition and every metric TRL logs
   there are TRL's;
4. **loss, one response at a time**: `training_step` replays response `i` under autograd on its group's state,
   builds its loss term with [`longstraw_trl.loss.response_loss`] (the terms sum to TRL's `_compute_loss` value for
   every loss type), back-propagates it with `accelerator.backward` and frees its graph before the next response.
   Under DDP, only the last backward of an optimizer step synchronises gradients (the others run under
   `accelerator.no_sync`).

The gradient is the *response-only* gradient: the prompt state is a constant (see docs/design.md, "Objective").

Prompt states live from generation until the generation batch has been consumed (`steps_per_generation` micro-batches,
`num_iterations` times); after an optimizer step they are stale, and [`~longstraw_trl.refresh.RefreshPolicy`] decides
whether to re-capture or reuse them (`refresh_policy`).

Micro-batch layout: a micro-batch holds whole groups (`per_device_train_batch_size` a multiple of `num_generations`).
TRL shuffles the rows of a generation batch before splitting it into micro-batches; here the *groups* are shuffled.

A cost inherited from reusing TRL's `_generate_and_score_completions`: while it scores a generation batch of `B`
completions it still builds its `(B, P)` prompt tensors and `(B, P + R)` sequence tensors (int64, about `32·B·P`
bytes on the device, e.g. 1 GiB for B = 8 and P = 4M; no model runs on them). The trainer drops the prompt tensors
from the batch it buffers; each group keeps its prompt ids once, on the CPU, to re-capture it.

Agent training (`tools`, `environment_factory`, `rollout_func`) runs TRL's own code on prompt states: see
`longstraw_trl.agents` (tool turns extend each rollout's state from its group's prompt state; the loss replays each final
completion on the group's state with TRL's `tool_mask`).

Refused at construction (each with a message saying what to change): `use_vllm`,
`use_transformers_continuous_batching`, `repetition_penalty != 1`, generation kwargs the shared-prefix sampler cannot
honour, `entropy_coef != 0`, `top_entropy_quantile < 1`, `use_adaptive_entropy`, a MoE router
auxiliary loss, multimodal processors, prompt-learning PEFT methods, DeepSpeed, FSDP, LOMO optimizers, datasets
without a `prompt` column and models `patch_model` does not support.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import ProcessorMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.utils import is_async_callable

from .adapters import adapters_in_model_dtype
from .agents import generate_tool_turn, grouped_rollout_func, tool_turns
from .config import LongStrawGRPOConfig, check_whole_groups
from .distributed import new_cp_groups
from .engine import capture_prompt
from .errors import LongStrawError, UnsupportedModelError
from .loss import GRPOLossSpec, aggregate_metrics, batch_loss_context, response_loss
from .model_patches import patch_model, unwrap_model
from .refresh import PROBE, RECAPTURE, RefreshPolicy
from .state import PromptState
from .state_cache import EXTEND, CachedPrompt, PromptStateCache, prompt_key

__all__ = [
    "LongStrawGRPOConfig",
    "LongStrawGRPOTrainer",
    "LongStrawTrainingError",
    "NonFiniteLossError",
    "RewardFunctionError",
]

logger = logging.getLogger(__name__)

REFRESH_STATE_FILE = "longstraw_refresh.json"
_NULL_CONTEXT = contextlib.nullcontext()

# Generation kwargs (TRL's `generation_kwargs` dict, `args.generation_kwargs` merged in) the sampler honours.
_HONOURED_GENERATION_KWARGS = {
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
}
# ... and those that do not change the samples (accepted, ignored).
_IGNORED_GENERATION_KWARGS = {
    "cache_implementation",
    "use_cache",
    "disable_compile",
    "return_dict_in_generate",
}


class LongStrawTrainingError(RuntimeError):
    """Training cannot continue (a reward function failed, a loss is not finite)."""


class RewardFunctionError(LongStrawTrainingError):
    """A reward function raised; the message names it."""


class NonFiniteLossError(LongStrawTrainingError):
    """A response's loss term is NaN or infinite; training stops before it is back-propagated."""


def _named_reward_function(func: Callable, name: str) -> Callable:
    """Wrap a reward function so that an exception says which function raised it."""

    def fail(exc: Exception):
        return RewardFunctionError(
            f"reward function {name!r} raised {type(exc).__name__}: {exc}. Fix the function (it receives "
            "prompts=, completions=, completion_ids= and every dataset column as keyword arguments, and must return "
            "one float or None per completion)."
        )

    if is_async_callable(func):

        async def wrapped(*args, **kwargs):
            try:
                return await func(*args, **kwargs)
            except RewardFunctionError:
                raise
            except Exception as exc:
                raise fail(exc) from exc

    else:

        def wrapped(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except RewardFunctionError:
                raise
            except Exception as exc:
                raise fail(exc) from exc

    wrapped.__name__ = getattr(func, "__name__", name)
    wrapped.__qualname__ = getattr(func, "__qualname__", name)
    wrapped.__wrapped__ = func
    return wrapped


def _dataset_columns(dataset) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict
        return None
    return list(names) if names is not None else None


def _check_prompt_column(dataset, name: str) -> None:
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for split, ds in dataset.items():
            _check_prompt_column(ds, f"{name}[{split!r}]")
        return
    columns = _dataset_columns(dataset)
    if columns is not None and "prompt" not in columns:
        raise LongStrawError(
            f"{name} has no 'prompt' column (columns: {', '.join(columns) or 'none'}). LongStrawGRPOTrainer needs one "
            "prompt per row in a column named 'prompt': a string, or a list of chat messages (the chat template is "
            "then applied as in TRL). Rename your column, e.g. dataset.rename_column('text', 'prompt')."
        )


def _refuse_unsupported(
    args: LongStrawGRPOConfig, tools, rollout_func, environment_factory, processing_class
):
    """Options the trainer cannot honour: fail at construction, never train on something else."""

    def refuse(what: str, fix: str):
        raise LongStrawError(f"LongStrawGRPOTrainer does not support {what}. {fix}")

    if args.use_vllm:
        refuse(
            "use_vllm=True",
            "Completions are sampled from the captured prompt state (shared-prefix decoding), not by vLLM. Set "
            "use_vllm=False.",
        )
    if args.use_transformers_continuous_batching:
        refuse("use_transformers_continuous_batching=True", "Set it to False.")
    if args.repetition_penalty != 1.0:
        refuse(
            f"repetition_penalty={args.repetition_penalty}",
            "The shared-prefix sampler applies temperature, top_k, top_p and min_p only. Set repetition_penalty=1.0.",
        )
    extra = dict(args.generation_kwargs or {})
    if extra.get("repetition_penalty", 1.0) != 1.0:
        refuse(f"generation_kwargs['repetition_penalty']={extra['repetition_penalty']}", "Remove it.")
    extra.pop("repetition_penalty", None)
    unknown = sorted(set(extra) - _HONOURED_GENERATION_KWARGS - _IGNORED_GENERATION_KWARGS)
    if unknown:
        refuse(
            f"generation_kwargs {unknown}",
            f"The shared-prefix sampler honours {sorted(_HONOURED_GENERATION_KWARGS)}; remove the others.",
        )
    if args.max_completion_length is None:
        refuse("max_completion_length=None", "Set max_completion_length to the longest completion to sample.")
    if args.entropy_coef != 0.0:
        refuse(
            f"entropy_coef={args.entropy_coef} (the entropy bonus)",
            "The replay computes differentiable log-probs only; set entropy_coef=0.0 (the entropy is still logged).",
        )
    if args.deepspeed:
        refuse(
            "DeepSpeed",
            "Launch with plain DDP (`accelerate launch` multi-GPU, no DeepSpeed) or a single process.",
        )
    if args.fsdp or getattr(args, "fsdp_config", None) and args.fsdp_config.get("version"):
        refuse("FSDP", "Launch with plain DDP (`accelerate launch` multi-GPU, no FSDP) or a single process.")
    if str(args.optim).lower().endswith("lomo"):
        refuse(
            f"optim={args.optim!r}",
            "LOMO optimizers update the weights inside backward(), but the loss is back-propagated one response at a "
            "time. Use another optimizer (e.g. adamw_torch).",
        )
    if isinstance(processing_class, ProcessorMixin):
        refuse(
            "multimodal processors (images)",
            "Pass the tokenizer as processing_class and text (or chat) prompts only.",
        )
    # Loss options (raises NotImplementedError for top_entropy_quantile < 1, use_adaptive_entropy, router aux loss)
    GRPOLossSpec.from_args(args)


def _check_model(model) -> None:
    """`patch_model` the policy (or the reference); refuse prompt-learning PEFT."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict):
        for name, cfg in peft_config.items():
            if getattr(cfg, "is_prompt_learning", False):
                raise UnsupportedModelError(
                    f"PEFT adapter {name!r} ({type(cfg).__name__}) is a prompt-learning method (virtual tokens or "
                    "prefix K/V), which the prompt state does not carry. Use LoRA-style adapters."
                )
    patch_model(model)


@contextlib.contextmanager
def _checkpointing_off(model):
    """Switch HF activation checkpointing off in every layer for a graph-free pass (TRL does the same)."""
    layers = [m for m in unwrap_model(model).modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


def _peak_memory_gib(device: torch.device) -> float | None:
    """CUDA: peak allocated memory of the device; CPU: peak resident set size of the process (GiB)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux
    except (ImportError, OSError):
        return None


class LongStrawGRPOTrainer(GRPOTrainer):
    """
    GRPO on very long prompts: TRL's [`~trl.GRPOTrainer`], with each prompt captured once per group into a read-only
    state that generation, the old/reference log-probs and the policy loss all replay on.

    Takes the same arguments as [`~trl.GRPOTrainer`] and a [`LongStrawGRPOConfig`] (`args`). The differences are
    described in the module docstring of `longstraw_trl.trainer`; in short, the summed per-response loss equals TRL's
    `_compute_loss` for every loss type, with gradients flowing through the response tokens only (the prompt state is
    a constant).

    Example:

    ```python
    from datasets import Dataset
    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    def reward(completions, answer, **kwargs):
        return [float(a in c) for c, a in zip(completions, answer)]

    trainer = LongStrawGRPOTrainer(
        model=model,  # a supported causal LM (see `longstraw_trl.supported_model_types()`)
        reward_funcs=reward,
        args=LongStrawGRPOConfig(output_dir="out", per_device_train_batch_size=8, num_generations=8),
        train_dataset=Dataset.from_dict({"prompt": [long_text], "answer": ["42"]}),
        processing_class=tokenizer,
    )
    trainer.train()
    ```

    Metrics (besides TRL's own; all under `longstraw/`): `prompt_tokens`, `state_bytes/<kind>` (per captured state),
    `live_state_bytes`, `peak_memory_gib` (CUDA max allocated, or the process's peak RSS on CPU), `capture_seconds`,
    `capture_tokens_per_second`, `generation_seconds`, `generation_tokens_per_second`, `logprob_replay_seconds`
    (graph-free old/reference replays), `replay_seconds` and `replay_tokens_per_second` (policy replay + backward),
    `refresh/<action>` (per step: `fresh`, `reuse`, `recapture`, `probe`, and `capture` for first captures),
    `refresh/state_age`, `refresh/interval`, `refresh/drift`.
    """

    _tag_names = ["trl", "grpo", "longstraw"]
    _name = "LongStraw GRPO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: LongStrawGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = LongStrawGRPOConfig(f"{str(name).split('/')[-1]}-LongStraw-GRPO")
        elif not isinstance(args, LongStrawGRPOConfig):
            raise TypeError(
                f"args must be a LongStrawGRPOConfig (got {type(args).__name__}); it takes every GRPOConfig field, "
                "e.g. LongStrawGRPOConfig(**your_grpo_kwargs)."
            )
        _refuse_unsupported(args, tools, rollout_func, environment_factory, processing_class)
        check_whole_groups(
            args.per_device_train_batch_size,
            args.num_generations,
            "per_device_train_batch_size",
            "num_generations",
        )
        _check_prompt_column(train_dataset, "train_dataset")
        _check_prompt_column(eval_dataset, "eval_dataset")
        if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
            raise UnsupportedModelError(
                f"{type(peft_config).__name__} is a prompt-learning PEFT method (virtual tokens or prefix K/V), which "
                "the prompt state does not carry. Use LoRA-style adapters."
            )
        if not isinstance(model, str):
            _check_model(model)  # before TRL loads a reference model or builds anything else

        # Set before `super().__init__` (TRL's `__init__` may already call overridden methods).
        self._batch_groups: list[str] | None = None
        self._tool_turn_keys: set[str] | None = None  # set while TRL's tool loop runs (`agents.tool_turns`)
        self.cp_group = None
        self.prompt_cache: PromptStateCache | None = None  # built once the refresh policy exists
        self._train_keys: set[str] = set()
        self._step_counts: dict[str, dict[str, float]] = {
            "train": defaultdict(float),
            "eval": defaultdict(float),
        }

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )

        _check_model(self.model)
        if self.ref_model is not None:
            _check_model(self.ref_model)
        self.loss_spec = GRPOLossSpec.from_args(args, model=unwrap_model(self.model))
        self.refresh_policy = RefreshPolicy(
            args.refresh_policy,
            args.refresh_interval,
            args.refresh_drift_threshold,
            args.refresh_probe_period,
            args.refresh_max_interval,
        )
        cache_bytes = None if args.prompt_cache_gib is None else int(args.prompt_cache_gib * 2**30)
        self.prompt_cache = PromptStateCache(
            self._capture_policy, self._extend, self.refresh_policy, cache_bytes
        )
        if self.rollout_func is not None:
            self.rollout_func = grouped_rollout_func(self.rollout_func)
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names, strict=True)):
            if not isinstance(func, nn.Module):
                self.reward_funcs[i] = _named_reward_function(func, name)
        self.cp_group = self._context_parallel_group(args.cp_size)

    def _context_parallel_group(self, cp_size: int):
        """This process's context-parallel group (consecutive ranks), or `None` for `cp_size == 1`."""
        if cp_size == 1:
            return None
        world = self.accelerator.num_processes
        if not dist.is_initialized() or world % cp_size:
            raise LongStrawError(
                f"cp_size={cp_size} needs a distributed launch whose world size is a multiple of it (got {world} "
                "process(es)); launch with e.g. `accelerate launch --config_file examples/accelerate/cp2.yaml`."
            )
        return new_cp_groups(cp_size)

    # ------------------------------------------------------------------------------------------------------------------
    # Capture and prompt-state bookkeeping
    # ------------------------------------------------------------------------------------------------------------------
    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _no_grad_context(self, model, cast_adapters: bool = False):
        """No autograd, no activation checkpointing (nothing to recompute), the accelerator's autocast; with
        `cast_adapters` (capture, generation: nothing is scored) adapters in the model's dtype if configured."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(_checkpointing_off(model))
        stack.enter_context(self.accelerator.autocast())
        enabled = cast_adapters and self.args.graph_free_adapters_in_model_dtype
        stack.enter_context(adapters_in_model_dtype(model, enabled))
        return stack

    def _capture(self, model, prompt_ids: torch.Tensor, role: str = "policy") -> PromptState:
        """Capture one prompt (1-D token ids) with `model`: every capture of the trainer goes through here.

        `role` (`"policy"` or `"reference"`) is only used for logging.
        """
        mode = self._mode
        start = time.perf_counter()
        with self._no_grad_context(model, cast_adapters=True):
            state = capture_prompt(
                model,
                prompt_ids,
                chunk_size=self.args.capture_chunk_size,
                page_size=self.args.page_size,
                offload=self.args.offload_prompt_state,
                cp_group=self.cp_group,
            )
        seconds = time.perf_counter() - start
        metrics = self._metrics[mode]
        metrics["longstraw/capture_seconds"].append(seconds)
        metrics["longstraw/capture_tokens_per_second"].append(state.num_tokens / max(seconds, 1e-9))
        metrics["longstraw/prompt_tokens"].append(float(state.num_tokens))
        for kind, nbytes in state.nbytes_by_kind().items():
            metrics[f"longstraw/state_bytes/{kind}"].append(float(nbytes))
        logger.info(
            "LongStraw: captured a %d-token prompt (%s) in %.2fs: %s",
            state.num_tokens,
            role,
            seconds,
            state,
        )
        return state

    def _capture_policy(self, prompt_ids: torch.Tensor) -> PromptState:
        return self._capture(self.model, prompt_ids)

    def _extend(self, state: PromptState, more_ids: torch.Tensor) -> PromptState:
        """A fork of `state` with `more_ids` appended (the prompt-state cache's prefix reuse)."""
        start = time.perf_counter()
        with self._no_grad_context(self.model, cast_adapters=True):
            new = state.extend(self.model, more_ids)
        metrics = self._metrics[self._mode]
        metrics["longstraw/extend_seconds"].append(time.perf_counter() - start)
        metrics["longstraw/extend_tokens"].append(float(more_ids.numel()))
        return new

    def _acquire(self, key: str, prompt_ids, purpose: str) -> CachedPrompt:
        """The policy state of a prompt: reused, extended from a cached prefix, or captured (refresh policy)."""
        counts = self._step_counts[self._mode]
        entry, action, age = self.prompt_cache.get(prompt_ids, self.state.global_step, key)
        counts[action] += 1
        if age is not None:
            counts["_age_sum"] += age
            counts["_age_n"] += 1
        logger.info("LongStraw refresh: prompt %s (%s) age %s -> %s", key, purpose, age, action)
        return entry

    def _finish_probe(self, entry: CachedPrompt, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """`adaptive` probe: drift of one response's log-probs between the stale and the fresh state."""
        stale, entry.probe_stale = entry.probe_stale, None
        n = int(mask.sum())
        if stale is None or n == 0:
            return
        ids, mask = ids[None, :n], mask[None, :n]
        with self._no_grad_context(self.model):
            old = stale.logprobs(self.model, ids, mask, self.temperature)
            new = entry.state.logprobs(self.model, ids, mask, self.temperature)
        drift = (old - new).abs().mean().item()
        interval = self.refresh_policy.record_drift(drift)
        self._metrics[self._mode]["longstraw/refresh/drift"].append(drift)
        logger.info(
            "LongStraw refresh: prompt %s drift %.4g nats/token, interval now %d", entry.key, drift, interval
        )

    def free_prompt_states(self) -> None:
        """Drop every captured prompt state (they are re-captured when needed)."""
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        self._train_keys = set()

    def live_state_bytes(self) -> int:
        """Bytes of the prompt states held (forks' shared pages counted once)."""
        return self.prompt_cache.nbytes() if self.prompt_cache is not None else 0

    # ------------------------------------------------------------------------------------------------------------------
    # Generation: TRL's `_generate_and_score_completions`, with the model work routed to the prompt states
    # ------------------------------------------------------------------------------------------------------------------
    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization (chat template included), once per run of identical prompts (a group)."""
        # with environments TRL renders each prompt with its environment's tools: a group is also one environment
        envs = self._batch_environments if self.environment_factories is not None else [None] * len(prompts)
        unique, unique_envs, index = [], [], []
        for prompt, env in zip(prompts, envs, strict=True):
            if not unique or not (prompt is unique[-1] or prompt == unique[-1]) or env != unique_envs[-1]:
                unique.append(prompt)
                unique_envs.append(env)
            index.append(len(unique) - 1)
        if self.environment_factories is not None:
            self._batch_environments = unique_envs
        try:
            prompt_ids, images, multimodal_fields = super()._tokenize_prompts(unique)
        finally:
            if self.environment_factories is not None:
                self._batch_environments = envs
        if images is not None or multimodal_fields:
            raise LongStrawError("LongStrawGRPOTrainer does not support images in prompts; use text prompts.")
        return [prompt_ids[j] for j in index], None, {}

    def _group_rows(self, prompt_ids: list, num_generations: int) -> list:
        """The prompt of each group of `num_generations` consecutive rows (which must share it)."""
        if len(prompt_ids) % num_generations != 0:
            raise LongStrawError(
                f"got {len(prompt_ids)} rows, not a multiple of num_generations={num_generations}: every prompt must "
                "come with its whole group of completions."
            )
        groups = []
        for start in range(0, len(prompt_ids), num_generations):
            first = prompt_ids[start]
            for row in range(start + 1, start + num_generations):
                if not (prompt_ids[row] is first or list(prompt_ids[row]) == list(first)):
                    raise LongStrawError(
                        f"rows {start}..{start + num_generations - 1} should be one group (one prompt repeated "
                        f"num_generations={num_generations} times, as TRL's RepeatSampler yields them), but row {row} "
                        "has another prompt. Use the trainer's own dataloader/sampler; an environment's reset() must "
                        "give the rollouts of one row the same observation; a rollout_func must return the rows of "
                        "a prompt consecutively, with identical prompt_ids."
                    )
            groups.append(first)
        return groups

    def _sampling_kwargs(self) -> dict[str, Any]:
        gk = self.generation_kwargs
        eos = gk.get("eos_token_id", self.eos_token_ids)
        return dict(
            max_new_tokens=gk.get("max_new_tokens", self.max_completion_length),
            temperature=gk.get("temperature", self.temperature),
            top_p=gk.get("top_p", self.top_p),
            top_k=gk.get("top_k", self.top_k),
            min_p=gk.get("min_p", self.min_p),
            do_sample=gk.get("do_sample", True),
            eos_token_id=eos,
            pad_token_id=gk.get("pad_token_id", self._tokenizer.pad_token_id),
        )

    def _sample_group(self, state: PromptState, num_generations: int) -> torch.Tensor:
        """`[G, R]` completions sampled from one prompt state (rows padded after their EOS)."""
        kwargs = self._sampling_kwargs()
        max_new_tokens = kwargs.pop("max_new_tokens")
        with self._no_grad_context(self.model, cast_adapters=True):
            return state.generate(self.model, num_generations, max_new_tokens, **kwargs)

    def _truncate_after_eos(self, completion_ids: torch.Tensor) -> list[list[int]]:
        """TRL's post-processing: keep each row up to and including its first EOS."""
        device = completion_ids.device
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=device))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        positions = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        keep = positions <= eos_idx.unsqueeze(1)
        return [row[m].tolist() for row, m in zip(completion_ids.cpu(), keep.cpu(), strict=True)]

    def _acquire_groups(self, prompt_ids, num_generations: int) -> tuple[list[str], dict[str, CachedPrompt]]:
        """The prompt state of each group of `num_generations` rows, recorded in `_batch_groups` (the groups of the
        old/reference log-probs and of the loss); the cache is pinned to this batch's prompts first."""
        if self._batch_groups is None:
            raise RuntimeError(
                "LongStrawGRPOTrainer: generation must go through _generate_and_score_completions"
            )
        mode = self._mode
        groups = self._group_rows(prompt_ids, num_generations)
        keys = [prompt_key(ids) for ids in groups]
        keep = set(keys) | (self._train_keys if mode == "eval" else set())
        # before capturing: free what will not be used (the old batch's states beyond the cache's budget)
        self.prompt_cache.pin(keep)
        self.prompt_cache.evict(self.state.global_step)
        if mode == "train":
            self._train_keys = set(keys)

        # shortest prompts first, so a prompt that extends another one of this batch finds its state
        entries = {}
        for i in sorted(range(len(groups)), key=lambda i: len(groups[i])):
            if keys[i] not in entries:
                entries[keys[i]] = self._acquire(keys[i], groups[i], purpose="generation")
        self._batch_groups.extend(keys)
        return keys, entries

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if images is not None or multimodal_fields:
            raise LongStrawError("LongStrawGRPOTrainer does not support images in prompts; use text prompts.")
        if self._tool_turn_keys is not None:  # TRL's tool loop: one row per rollout, never a loss group
            return generate_tool_turn(self, prompt_ids)
        mode = self._mode
        keys, entries = self._acquire_groups(prompt_ids, num_generations)
        completion_ids: list[list[int]] = []
        seconds, new_tokens = 0.0, 0
        for key in keys:
            entry = entries[key]
            start = time.perf_counter()
            sampled = self._sample_group(entry.state, num_generations)
            seconds += time.perf_counter() - start
            rows = self._truncate_after_eos(sampled)
            new_tokens += sum(len(r) for r in rows)
            if entry.probe_stale is not None:
                probe = torch.tensor(rows[0], dtype=torch.long)
                self._finish_probe(entry, probe, torch.ones_like(probe))
            completion_ids.extend(rows)
        metrics = self._metrics[mode]
        metrics["longstraw/generation_seconds"].append(seconds)
        metrics["longstraw/generation_tokens_per_second"].append(new_tokens / max(seconds, 1e-9))
        metrics["longstraw/live_state_bytes"].append(float(self.live_state_bytes()))
        return completion_ids, None

    def _tool_call_loop(self, *args, **kwargs):
        """TRL's tool loop; its generation calls extend each rollout's own state (`agents.generate_tool_turn`)."""
        with tool_turns(self):
            return super()._tool_call_loop(*args, **kwargs)

    def _is_reference_call(self, model) -> bool:
        """Whether TRL asks for reference log-probs: the separate `ref_model`, or the policy with adapters off/"ref"."""
        if self.beta == 0.0:
            return False
        if self.ref_model is not None:
            return model is self.ref_model
        peft_model = self.accelerator.unwrap_model(self.model)
        if not hasattr(peft_model, "peft_config"):
            return False
        if "ref" in peft_model.peft_config and getattr(peft_model, "active_adapter", None) == "ref":
            return True
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in peft_model.modules():
            if isinstance(module, BaseTunerLayer):
                return bool(module.disable_adapters)
        return False

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        **kwargs,
    ):
        """Old-policy / reference log-probs of TRL's generation step, as graph-free replays on the prompt states.

        TRL calls this from `_generate_and_score_completions` with `prompt + completion` ids; only the completion
        part is used: the prompt of each group is its captured state (the reference gets its own capture).
        """
        if self._batch_groups is None:
            raise RuntimeError(
                "LongStrawGRPOTrainer replays responses on captured prompt states; TRL's full-sequence log-prob path "
                "is only routed here from _generate_and_score_completions."
            )
        if kwargs.get("compute_aux_loss"):
            raise LongStrawError(
                "MoE router auxiliary losses are not supported; set router_aux_loss_coef=0.0"
            )
        ids = input_ids[:, -logits_to_keep:]
        mask = attention_mask[:, -logits_to_keep:]
        groups = self._batch_groups
        size = ids.size(0) // len(groups)
        reference = self._is_reference_call(model)
        out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        start = time.perf_counter()
        for g, key in enumerate(groups):
            rows = slice(g * size, (g + 1) * size)
            length = int((mask[rows].sum(0) > 0).sum())  # right padding: the longest row of the group
            if length == 0:
                continue
            entry = self.prompt_cache[key]
            state = self._capture(model, entry.prompt_ids, role="reference") if reference else entry.state
            with self._no_grad_context(model):
                logps = state.logprobs(model, ids[rows, :length], mask[rows, :length], self.temperature)
            out[rows, :length] = logps.to(out.device) * mask[rows, :length]
            del state, logps
        self._metrics[self._mode]["longstraw/logprob_replay_seconds"].append(time.perf_counter() - start)
        return out, None, None

    def _generate_and_score_completions(self, inputs):
        if inputs and "prompt" not in inputs[0]:
            raise LongStrawError(
                f"the dataset rows have no 'prompt' field (fields: {', '.join(inputs[0]) or 'none'}). "
                "LongStrawGRPOTrainer needs one prompt per row in a column named 'prompt'."
            )
        if self.cp_group is not None:
            # every rank of a context-parallel group works on its first rank's prompts
            box = [inputs]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.cp_group, 0), group=self.cp_group)
            inputs = box[0]
        self._batch_groups = []
        try:
            output = super()._generate_and_score_completions(inputs)
            groups = list(self._batch_groups)
        finally:
            self._batch_groups = None
        # The prompt states stand for the (B, P) prompt tensors: keep each group's token ids once, on the CPU.
        output.pop("prompt_ids", None)
        output.pop("prompt_mask", None)
        output["longstraw_prompts"] = [(key, self.prompt_cache[key].prompt_ids) for key in groups]
        return output

    def _split_by_groups(self, batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
        """Shuffle the groups of a generation batch and split it into `num_chunks` micro-batches of whole groups."""
        prompts = batch["longstraw_prompts"]
        rows = batch["completion_ids"].size(0)
        size = rows // len(prompts)
        if len(prompts) % num_chunks != 0:
            raise LongStrawError(
                f"a generation batch of {len(prompts)} groups cannot be split into {num_chunks} micro-batches of "
                "whole groups; make per_device_train_batch_size a multiple of num_generations."
            )
        order = torch.randperm(len(prompts)).tolist()
        if self.cp_group is not None:  # the ranks of a CP group must replay the same responses in step
            box = [order]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.cp_group, 0), group=self.cp_group)
            order = box[0]
        per_chunk = len(prompts) // num_chunks
        chunks = []
        for c in range(num_chunks):
            group_ids = order[c * per_chunk : (c + 1) * per_chunk]
            index = torch.cat([torch.arange(g * size, (g + 1) * size) for g in group_ids])
            chunk = {}
            for name, value in batch.items():
                if name == "longstraw_prompts":
                    chunk[name] = [prompts[g] for g in group_ids]
                elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == rows:
                    chunk[name] = value[index.to(value.device)]
                else:
                    chunk[name] = value
            chunks.append(chunk)
        return chunks

    def _prepare_inputs(self, generation_batch):
        if self._mode == "train":
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:
                batch = self._generate_and_score_completions(generation_batch)
                self._buffered_inputs = self._split_by_groups(batch, self.args.steps_per_generation)
            return self._buffered_inputs[self._step % self.args.steps_per_generation]
        return self._generate_and_score_completions(generation_batch)

    # ------------------------------------------------------------------------------------------------------------------
    # The policy loss, one response at a time
    # ------------------------------------------------------------------------------------------------------------------
    def _policy_replay(self, model, state: PromptState, ids: torch.Tensor, mask: torch.Tensor):
        """`[L]` log-probs (with autograd when enabled) and `[L]` entropies (no gradient) of one response.

        `model` may be DDP-wrapped: the engine enters it through its root forward, so DDP prepares its gradient
        reduction as for any forward."""
        with self.accelerator.autocast():
            logps, entropy = state.logprobs(
                model,
                ids,
                mask,
                self.temperature,
                grad=torch.is_grad_enabled(),
                checkpoint_layers=self.args.replay_checkpoint_layers,
                return_entropy=True,
            )
        return logps[0], entropy.reshape(-1)

    def _streamed_loss(self, model, inputs: dict[str, Any], backward: bool) -> torch.Tensor:
        """TRL's `_compute_loss` value for this micro-batch, computed (and back-propagated) one response at a time."""
        mode = self._mode
        spec = self.loss_spec
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        ctx = batch_loss_context(
            spec,
            loss_mask,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            training=mode == "train",
        )
        prompts = inputs["longstraw_prompts"]
        num_rows, width = completion_ids.shape
        size = num_rows // len(prompts)
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps")
        sampling = inputs.get("sampling_per_token_logps")
        advantages = inputs["advantages"]
        device = completion_ids.device

        # Under DDP, one backward per micro-batch synchronises gradients (DDP really reduces only in the last
        # micro-batch of an optimizer step: the Trainer runs the others under `no_sync`): that of the longest response,
        # whose group is processed last and which runs last in its group; every other response runs under
        # `accelerator.no_sync`. A rank without any loss token still takes part, with a zero-weighted replay.
        sync_row = None
        group_order = list(range(len(prompts)))
        if backward and self.accelerator.num_processes > 1:
            with_tokens = [i for i in range(num_rows) if ctx.lengths[i] > 0]
            sync_row = max(with_tokens, key=lambda i: ctx.lengths[i]) if with_tokens else 0
            group_order.remove(sync_row // size)
            group_order.append(sync_row // size)

        def cut(x, i, length):
            return None if x is None else x[i, :length]

        total = torch.zeros((), device=self.accelerator.device)
        all_metrics = []
        replay_seconds, replay_tokens = 0.0, 0
        for g in group_order:
            key, prompt_ids = prompts[g]
            entry = self._acquire(key, prompt_ids, purpose="loss")
            rows = list(range(g * size, (g + 1) * size))
            if entry.probe_stale is not None:
                probe = next((i for i in rows if ctx.lengths[i] > 0), None)
                if probe is not None:
                    self._finish_probe(entry, completion_ids[probe], loss_mask[probe])
                else:
                    entry.probe_stale = None
            if sync_row in rows:  # the synchronising response runs last
                rows.remove(sync_row)
                rows.append(sync_row)
            for i in rows:
                length = ctx.lengths[i]
                if length == 0 and i != sync_row:
                    # No loss token: its term is exactly zero (TRL's sums multiply it by the mask); no replay.
                    zeros = torch.zeros(1, device=device)
                    term, metrics = response_loss(
                        spec, ctx, i, zeros, cut(old, i, 1), cut(ref, i, 1), advantages[i], entropies_i=zeros
                    )
                    all_metrics.append(metrics)
                    total = total + term.detach()
                    continue
                if i == sync_row:  # a 1-token replay skips the decoder layers, whose parameters DDP expects
                    length = max(length, min(2, width))
                sync = (
                    self.accelerator.no_sync(model)
                    if sync_row is not None and i != sync_row
                    else _NULL_CONTEXT
                )
                start = time.perf_counter()
                with sync:
                    logps, entropies = self._policy_replay(
                        model,
                        entry.state,
                        completion_ids[i : i + 1, :length],
                        completion_mask[i : i + 1, :length],
                    )
                    term, metrics = response_loss(
                        spec,
                        ctx,
                        i,
                        logps,
                        cut(old, i, length),
                        cut(ref, i, length),
                        advantages[i],
                        sampling_logps_i=cut(sampling, i, length),
                        entropies_i=entropies,
                    )
                    if not torch.isfinite(term.detach()):
                        self._raise_non_finite(term, i, g, entry, length, logps, old, ref, advantages)
                    if ctx.lengths[i] == 0:
                        term = term * 0.0
                    if backward:
                        self.accelerator.backward(term)
                replay_seconds += time.perf_counter() - start
                replay_tokens += length
                total = total + term.detach()
                all_metrics.append(metrics)
                del logps, entropies, term

        for name, value in aggregate_metrics(
            spec,
            all_metrics,
            reduce_sum=lambda t: self.accelerator.reduce(t, reduction="sum"),
            gather=self.accelerator.gather,
        ).items():
            self._metrics[mode][name].append(value)
        self._metrics[mode]["longstraw/replay_seconds"].append(replay_seconds)
        self._metrics[mode]["longstraw/replay_tokens_per_second"].append(
            replay_tokens / max(replay_seconds, 1e-9)
        )
        return total

    def _raise_non_finite(self, term, i, g, entry, length, logps, old, ref, advantages):
        suspects = []
        if not torch.isfinite(logps.detach()).all():
            suspects.append("the policy log-probs (diverged weights? lower the learning rate)")
        if old is not None and not torch.isfinite(old[i, :length]).all():
            suspects.append("the old-policy log-probs")
        if ref is not None and not torch.isfinite(ref[i, :length]).all():
            suspects.append("the reference log-probs")
        if not torch.isfinite(advantages[i]).all():
            suspects.append("the advantage (check the reward functions)")
        raise NonFiniteLossError(
            f"non-finite loss ({term.item()}) at global step {self.state.global_step + 1} (micro-step {self._step}), "
            f"group {g} of the micro-batch (prompt {entry.key}, {entry.prompt_ids.numel()} tokens), response {i} "
            f"({length} tokens); non-finite inputs: {', '.join(suspects) or 'none (the loss terms overflowed)'}. "
            "Training stopped before back-propagating it."
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch loss without back-propagation (evaluation); training goes through `training_step`."""
        if return_outputs:
            raise ValueError("LongStrawGRPOTrainer does not support returning outputs")
        return self._streamed_loss(model, inputs, backward=False)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Prepare the micro-batch (generating when TRL would), then back-propagate its loss one response at a time.

        Structure (`Trainer.training_step` + `GRPOTrainer.training_step`, with the single `backward` replaced):
        `model.train()`, `_prepare_inputs` (generation + scoring every `steps_per_generation * num_iterations` steps,
        else the buffered micro-batch), then for each group of the micro-batch: its prompt state (refresh policy), then
        for each response: replay with autograd, loss term, `accelerator.backward`, graph freed. Returns the detached
        sum of the terms: TRL's `_compute_loss` value for the micro-batch.
        """
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self._streamed_loss(model, inputs, backward=True)
        del inputs
        if (
            self.args.torch_empty_cache_steps is not None
            and self.state.global_step % self.args.torch_empty_cache_steps == 0
        ):
            from accelerate.utils import clear_device_cache

            clear_device_cache()
        self._step += 1
        self._flush_step_counts("train")
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss.detach()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._flush_step_counts("eval")
            # evaluation states are not pinned: the cache keeps them only within its budget
            self.prompt_cache.pin(self._train_keys)
            self.prompt_cache.evict(self.state.global_step)

    def _flush_step_counts(self, mode: str) -> None:
        counts = self._step_counts[mode]
        metrics = self._metrics[mode]
        for action in ("capture", EXTEND, "fresh", "reuse", RECAPTURE, PROBE):
            metrics[f"longstraw/refresh/{action}"].append(counts.get(action, 0.0))
        if self.prompt_cache is not None:
            for name, tokens in self.prompt_cache.pop_stats().items():
                metrics[f"longstraw/{name}"].append(float(tokens))
        if counts.get("_age_n"):
            metrics["longstraw/refresh/state_age"].append(counts["_age_sum"] / counts["_age_n"])
        metrics["longstraw/refresh/interval"].append(float(self.refresh_policy.interval))
        peak = _peak_memory_gib(self.accelerator.device)
        if peak is not None:
            metrics["longstraw/peak_memory_gib"].append(peak)
        counts.clear()

    # ------------------------------------------------------------------------------------------------------------------
    # Training entry point and checkpoints
    # ------------------------------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self.free_prompt_states()
            self._buffered_inputs = None

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            with open(os.path.join(folder, REFRESH_STATE_FILE), "w") as f:
                json.dump(self.refresh_policy.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            path = os.path.join(checkpoint, REFRESH_STATE_FILE)
            if os.path.exists(path):
                with open(path) as f:
                    self.refresh_policy.load_state_dict(json.load(f))
