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

Micro-batch layout: a process's generation batch holds whole groups; TRL shuffles its rows before splitting it into
micro-batches, here the *groups* are shuffled and their rows split in that order, so a micro-batch holds whole
groups, or parts of at most a few (`longstraw_row_group` maps each row to its prompt; the group's state stays
cached until the generation batch has been consumed).

A cost inherited from reusing TRL's `_generate_and_score_completions`: while it scores a generation batch of `B`
completions it still builds its `(B, P)` prompt tensors and `(B, P + R)` sequence tensors (int64, about `32·B·P`
bytes on the device, e.g. 1 GiB for B = 8 and P = 4M; no model runs on them). The trainer drops the prompt tensors
from the batch it buffers; each group keeps its prompt ids once, on the CPU, to re-capture it.

Agent training (`tools`, `environment_factory`, `rollout_func`) runs TRL's own code on prompt states: see
`longstraw_trl.agents` (tool turns extend each rollout's state from its group's prompt state; the loss replays each final
completion on the group's state with TRL's `tool_mask`).

Entropy options (TRL's semantics): the entropy bonus (`entropy_coef`) back-propagates the replay's differentiable
per-token entropies (chunked and checkpointed like the log-probs). `use_adaptive_entropy` runs TRL's controller on
TRL's own attributes (`entropy_coef`, `_last_world_entropy`, `_entropy_window_stats`): the coefficient applied during
an accumulation window is the one set at its start; at its end the window's token-weighted entropy (on the tokens the
bonus acts on, summed over processes) moves it by `entropy_coef_delta`. `top_entropy_quantile < 1` needs the
micro-batch's entropy quantile before the first loss term: every micro-batch first replays its responses without
autograd (one forward per group, its rows batched), i.e. one extra graph-free replay per response: at most about a
third of the replay + backward cost (a quarter with gradient checkpointing), 5-15% of it on the CPU test model. The
mask then comes from TRL's `get_high_entropy_mask`.

Evaluation (`evaluate()`, alone or during training) follows TRL: `num_generations_eval` completions per prompt, no
accumulation scaling, metrics under `eval_*`; it leaves the training state alone (buffered generation batch, prompt
states of the training batch, entropy controller).

Refused at construction (each with a message saying what to change): `use_vllm`, `use_transformers_continuous_batching`, generation kwargs the shared-prefix sampler cannot honour
(beam search, `typical_p`, `stop_strings`, ...; `repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`,
`sequence_bias`, `min_length`, `min_new_tokens`, `suppress_tokens` and `begin_suppress_tokens` are honoured),
`top_entropy_quantile < 1` with `cp_size > 1`, a MoE router auxiliary loss on a model whose HF forward computes
none (e.g. `glm4_moe`) or with `cp_size > 1`, multimodal processors, prompt-learning PEFT methods, DeepSpeed, FSDP,
LOMO optimizers, datasets without a `prompt` column and models `patch_model` does not support.

The MoE router load-balancing loss (`router_aux_loss_coef`, TRL's default being the model config's coefficient) is
exact: see `longstraw_trl/router_aux.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import weakref
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

from .adapters import adapters_in_model_dtype, bind_expert_adapters
from .agents import generate_tool_turn, grouped_rollout_func, tool_turns
from .config import LongStrawGRPOConfig, check_train_groups, check_whole_groups
from .distributed import new_cp_groups
from .engine import StateGrads, capture_prompt, prompt_backward, replay_blocks_backward
from .errors import LongStrawError, UnsupportedModelError
from .fused_forwards import fused_elementwise_forwards
from .loss import (
    GRPOLossSpec,
    adaptive_entropy_coef,
    aggregate_metrics,
    applied_entropy_coef,
    batch_loss_context,
    loss_lengths,
    response_loss,
)
from .model_patches import patch_model, unwrap_model
from .refresh import PROBE, RECAPTURE, RefreshPolicy
from .router_aux import RouterLoadBalancing, RouterStats, prepare_micro_batch, replay_inputs
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

# Generation kwargs (TRL's `generation_kwargs` dict, `args.generation_kwargs` merged in) the sampler honours
# exactly as `model.generate` applies them (longstraw_trl.generation.LogitsProcessing).
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
    "repetition_penalty",
    "sequence_bias",
    "bad_words_ids",
    "no_repeat_ngram_size",
    "min_length",
    "min_new_tokens",
    "suppress_tokens",
    "begin_suppress_tokens",
}
# ... refused by name, unless set to the value that does nothing: (no-op values, why)
_REFUSED_GENERATION_KWARGS = {
    "num_beams": ((None, 1), "beam search is not shared-prefix sampling"),
    "num_return_sequences": ((None, 1), "use num_generations"),
    "max_length": ((None,), "use max_completion_length (max_length counts the prompt)"),
    "typical_p": ((None, 1.0), "the sampler applies temperature, top_k, top_p and min_p only"),
    "epsilon_cutoff": ((None, 0.0), "the sampler applies temperature, top_k, top_p and min_p only"),
    "eta_cutoff": ((None, 0.0), "the sampler applies temperature, top_k, top_p and min_p only"),
    "top_h": ((None,), "the sampler applies temperature, top_k, top_p and min_p only"),
    "forced_bos_token_id": ((None,), "not implemented in the shared-prefix sampler"),
    "forced_eos_token_id": ((None,), "not implemented in the shared-prefix sampler"),
    "exponential_decay_length_penalty": ((None,), "not implemented in the shared-prefix sampler"),
    "renormalize_logits": ((None, False), "not implemented in the shared-prefix sampler"),
    "remove_invalid_values": ((None, False), "not implemented in the shared-prefix sampler"),
    "guidance_scale": ((None, 1.0), "classifier-free guidance needs a second, unconditional prompt"),
    "stop_strings": ((None,), "stop strings are decoded text; use eos_token_id"),
    "encoder_repetition_penalty": ((None, 1.0), "encoder-decoder models only"),
    "encoder_no_repeat_ngram_size": ((None, 0), "encoder-decoder models only"),
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
    extra = dict(args.generation_kwargs or {})
    for name, (noop, why) in _REFUSED_GENERATION_KWARGS.items():
        if name in extra and extra.pop(name) not in noop:
            refuse(
                f"generation_kwargs['{name}']",
                f"The shared-prefix sampler cannot honour it: {why}. Remove it.",
            )
    unknown = sorted(set(extra) - _HONOURED_GENERATION_KWARGS - _IGNORED_GENERATION_KWARGS)
    if unknown:
        refuse(
            f"generation_kwargs {unknown}",
            f"The shared-prefix sampler honours {sorted(_HONOURED_GENERATION_KWARGS)}; remove the others.",
        )
    if args.max_completion_length is None:
        refuse("max_completion_length=None", "Set max_completion_length to the longest completion to sample.")
    if args.top_entropy_quantile < 1.0 and args.cp_size > 1:
        refuse(
            f"top_entropy_quantile={args.top_entropy_quantile} with cp_size={args.cp_size}",
            "The entropy quantile is taken over the entropies gathered from every process, and the ranks of a "
            "context-parallel group hold the same responses (each would count cp_size times). Set cp_size=1 or "
            "top_entropy_quantile=1.0.",
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
    if args.gradient_mode == "full" and (
        tools or rollout_func is not None or environment_factory is not None
    ):
        refuse(
            "gradient_mode='full' with tools, environment_factory or rollout_func",
            "The full gradient is carried through captured prompts only, not through tool turns. Use "
            "gradient_mode='response_only'.",
        )
    # Loss options (raises NotImplementedError for what the per-response loss cannot stream)
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
    _bind_expert_adapters(model)
    patch_model(model)


def _bind_expert_adapters(model) -> None:
    """LoRA on fused MoE expert weights (peft's ``ParamWrapper``) runs through the activations in every pass
    (:func:`longstraw_trl.adapters.bind_expert_adapters`): peft's own forward forms every expert's adapted
    weight, a copy of the expert stack, in each forward and backward (a GLM-5 slice's decode step: 146-152 ms
    against 2.8 ms without LoRA). peft's "all-linear" maps onto these weights for MoE models converted from
    transformers v4, and then leaves the dense layers' MLP without LoRA: logged, since it surprises."""
    bound = bind_expert_adapters(model)
    if bound:
        logger.info(
            "LoRA on the fused expert weights of %d MoE block(s) (peft ParamWrapper) runs through the activations. "
            "peft maps 'all-linear' onto the experts for this model type and leaves the dense MLP layers without "
            "LoRA; name the projections in target_modules to choose.",
            bound,
        )


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
    `live_state_bytes`, `peak_memory_gib` (CUDA max allocated, or the process's peak RSS on CPU; and
    `capture_peak_memory_gib`, the same when the step's captures end), `capture_seconds`,
    `capture_tokens_per_second`, `generation_seconds`, `generation_tokens_per_second`, `logprob_replay_seconds`
    (graph-free old/reference replays), `entropy_pass_seconds` (the graph-free entropy replays of
    `top_entropy_quantile < 1`), `replay_seconds` and `replay_tokens_per_second` (policy replay + backward),
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
        check_train_groups(args)
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
        # MoE load-balancing loss (longstraw_trl.router_aux): the routers, and each policy state's prompt statistics
        self._router_aux = None
        self._router_prompt_stats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if self.loss_spec.router_aux_loss_coef != 0.0:
            if args.cp_size > 1:
                raise LongStrawError(
                    "router_aux_loss_coef != 0 is not supported with context parallelism (cp_size > 1) yet; set "
                    "router_aux_loss_coef=0.0 or cp_size=1."
                )
            if args.gradient_mode == "full" or args.replay_block_size is not None:
                raise LongStrawError(
                    "router_aux_loss_coef != 0 is not supported with gradient_mode='full' or replay_block_size (the "
                    "router loss of the prompt's tokens would need its own gradient). Set router_aux_loss_coef=0.0, "
                    "or gradient_mode='response_only' and replay_block_size=None."
                )
            self._router_aux = RouterLoadBalancing(self.model)
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
        `cast_adapters` (capture, generation, extension: nothing is scored) adapters in the model's dtype and the
        fused norm / MLP kernels, if configured."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(_checkpointing_off(model))
        stack.enter_context(self.accelerator.autocast())
        enabled = cast_adapters and self.args.graph_free_adapters_in_model_dtype
        stack.enter_context(adapters_in_model_dtype(model, enabled))
        stack.enter_context(
            fused_elementwise_forwards(model, cast_adapters and self.args.graph_free_fused_kernels)
        )
        return stack

    def _capture(self, model, prompt_ids: torch.Tensor, role: str = "policy") -> PromptState:
        """Capture one prompt (1-D token ids) with `model`: every capture of the trainer goes through here.

        `role` (`"policy"` or `"reference"`) is only used for logging.
        """
        mode = self._mode
        start = time.perf_counter()
        collect = self._router_aux is not None and role == "policy"
        router_stats = self._router_aux.collect() if collect else _NULL_CONTEXT
        with self._no_grad_context(model, cast_adapters=True), router_stats as stats:
            state = capture_prompt(
                model,
                prompt_ids,
                chunk_size=self.args.capture_chunk_size,
                page_size=self.args.page_size,
                offload=self.args.offload_prompt_state,
                cp_group=self.cp_group,
                keep_boundaries=self.args.gradient_mode == "full" and role == "policy",
            )
        if collect:  # the router statistics of the P - 1 captured tokens (none for a one-token prompt)
            self._router_prompt_stats[state] = stats[0] if stats else self._no_router_stats(state.device)
        seconds = time.perf_counter() - start
        metrics = self._metrics[mode]
        metrics["longstraw/capture_seconds"].append(seconds)
        metrics["longstraw/capture_tokens_per_second"].append(state.num_tokens / max(seconds, 1e-9))
        metrics["longstraw/prompt_tokens"].append(float(state.num_tokens))
        peak = _peak_memory_gib(self.accelerator.device)
        if peak is not None:  # the step's peak so far: its captures come first, so this is theirs
            metrics["longstraw/capture_peak_memory_gib"].append(peak)
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

    def _no_router_stats(self, device) -> RouterStats:
        zeros = torch.zeros(self._router_aux.num_experts, device=device)
        return RouterStats(zeros, zeros.clone(), torch.zeros((), device=device))

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
            repetition_penalty=gk.get("repetition_penalty", self.repetition_penalty) or 1.0,
            sequence_bias=gk.get("sequence_bias"),
            bad_words_ids=gk.get("bad_words_ids"),
            no_repeat_ngram_size=gk.get("no_repeat_ngram_size"),
            min_length=gk.get("min_length"),
            min_new_tokens=gk.get("min_new_tokens"),
            suppress_tokens=gk.get("suppress_tokens"),
            begin_suppress_tokens=gk.get("begin_suppress_tokens"),
        )

    def _sample_group(
        self, state: PromptState, num_generations: int, prompt_ids=None, input_length: int | None = None
    ) -> torch.Tensor:
        """`[G, R]` completions sampled from one prompt state (rows padded after their EOS). `prompt_ids` and
        `input_length` (TRL's left-padded row length) are what `model.generate` would see of the prompt."""
        kwargs = self._sampling_kwargs()
        max_new_tokens = kwargs.pop("max_new_tokens")
        if prompt_ids is not None:
            kwargs["prompt_ids"] = torch.as_tensor(prompt_ids, dtype=torch.long)
        with self._no_grad_context(self.model, cast_adapters=True):
            return state.generate(
                self.model, num_generations, max_new_tokens, input_length=input_length, **kwargs
            )

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

    def _padded_prompt_length(self, lengths) -> int:
        """The row length TRL left-pads one generation call's prompts to (what `generate`'s min_length counts)."""
        length = max(lengths)
        multiple = getattr(self, "pad_to_multiple_of", None)
        return -(-length // multiple) * multiple if multiple else length

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
        input_length = self._padded_prompt_length(entries[key].prompt_ids.numel() for key in keys)
        for key in keys:
            entry = entries[key]
            start = time.perf_counter()
            sampled = self._sample_group(entry.state, num_generations, entry.prompt_ids, input_length)
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
                "TRL's full-sequence MoE aux-loss path is not used here: the trainer streams the load-balancing loss "
                "per response in _streamed_loss (longstraw_trl.router_aux)"
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
        """Shuffle the groups of a generation batch, then split its rows in that order into `num_chunks` micro-batches.

        A micro-batch holds the prompts of the groups it has rows of (`longstraw_prompts`) and, per row, the index of
        its prompt among them (`longstraw_row_group`); a group cut by a micro-batch boundary is replayed from the same
        cached state in both micro-batches."""
        prompts = batch["longstraw_prompts"]
        rows = batch["completion_ids"].size(0)
        size = rows // len(prompts)
        if rows % num_chunks != 0:
            raise LongStrawError(
                f"a generation batch of {rows} completions cannot be split into {num_chunks} equal micro-batches"
            )
        order = torch.randperm(len(prompts)).tolist()
        if self.cp_group is not None:  # the ranks of a CP group must replay the same responses in step
            box = [order]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.cp_group, 0), group=self.cp_group)
            order = box[0]
        row_order = torch.cat([torch.arange(g * size, (g + 1) * size) for g in order])
        per_chunk = rows // num_chunks
        chunks = []
        for c in range(num_chunks):
            index = row_order[c * per_chunk : (c + 1) * per_chunk]
            row_groups = (index // size).tolist()
            group_ids = list(dict.fromkeys(row_groups))  # in order of appearance
            position = {g: j for j, g in enumerate(group_ids)}
            chunk = {}
            for name, value in batch.items():
                if name == "longstraw_prompts":
                    chunk[name] = [prompts[g] for g in group_ids]
                elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == rows:
                    chunk[name] = value[index.to(value.device)]
                else:
                    chunk[name] = value
            chunk["longstraw_row_group"] = torch.tensor([position[g] for g in row_groups])
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
    def _segment_context(self, model):
        """Around a call that recomputes segments under autograd (the full gradient, reverse block replay): the
        accelerator's autocast, and the engine's own (non-reentrant) layer checkpointing in place of HF's, since a
        segment hands its layers' K/V and states out of the layer (a reentrant checkpoint would cut their graph)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.accelerator.autocast())
        stack.enter_context(_checkpointing_off(model))
        return stack

    @property
    def _segment_checkpoint_layers(self) -> bool:
        return bool(self.args.gradient_checkpointing or self.args.replay_checkpoint_layers)

    def _policy_replay(
        self,
        model,
        state: PromptState,
        ids: torch.Tensor,
        mask: torch.Tensor,
        entropy_grad: bool = False,
        grads: StateGrads | None = None,
    ):
        """`[k, L]` log-probs (with autograd when enabled) and `[k, L]` entropies (with autograd only for
        `entropy_grad`: an entropy bonus) of `k` responses of one prompt state, replayed together.

        `model` may be DDP-wrapped: the engine enters it through its root forward, so DDP prepares its gradient
        reduction as for any forward."""
        context = self._segment_context(model) if grads is not None else self.accelerator.autocast()
        checkpoint_layers = (
            self._segment_checkpoint_layers if grads is not None else self.args.replay_checkpoint_layers
        )
        with context:
            logps, entropy = state.logprobs(
                model,
                ids,
                mask,
                self.temperature,
                grad=torch.is_grad_enabled(),
                checkpoint_layers=checkpoint_layers,
                return_entropy=True,
                entropy_grad=entropy_grad,
                grads=grads,
            )
        return logps, entropy.reshape(logps.shape)

    def _block_replay_backward(
        self, model, state: PromptState, ids: torch.Tensor, loss_term, entropy_grad, grads, sync
    ):
        """Reverse block replay of one response (`replay_block_size`): the engine back-propagates `loss_term(logps,
        entropies)` block by block (the last backward under DDP's sync when `sync`, the others not)."""
        no_sync = (lambda: self.accelerator.no_sync(model)) if sync else None
        with self._segment_context(model):
            return replay_blocks_backward(
                state,
                model,
                ids,
                self.args.replay_block_size,
                loss_term,
                self.temperature,
                grads=grads,
                return_entropy=True,
                entropy_grad=entropy_grad,
                checkpoint_layers=self._segment_checkpoint_layers,
                no_sync=no_sync,
            )

    def _loss_entry(self, entries: dict, inputs: dict[str, Any], g: int, rows: list[int], lengths, loss_mask):
        """Group `g`'s prompt state for the loss (its rows `rows` of the micro-batch), acquired (refresh policy,
        adaptive probe) once per micro-batch."""
        if g not in entries:
            key, prompt_ids = inputs["longstraw_prompts"][g]
            entry = self._acquire(key, prompt_ids, purpose="loss")
            if entry.probe_stale is not None:
                probe = next((i for i in rows if lengths[i] > 0), None)
                if probe is not None:
                    self._finish_probe(entry, inputs["completion_ids"][probe], loss_mask[probe])
                else:
                    entry.probe_stale = None
            entries[g] = entry
        return entries[g]

    def _high_entropy_mask(
        self, entries: dict, inputs: dict[str, Any], rows_of: list[list[int]], lengths, loss_mask
    ):
        """TRL's `top_entropy_quantile` token mask of the micro-batch, from a graph-free entropy pass.

        TRL takes the quantile over the entropies of the whole micro-batch (all processes) before any loss term; the
        loss here replays one response at a time, so every response with loss tokens is first replayed without
        autograd (one forward per group, its rows batched, on the state the loss then uses) and TRL's own
        `get_high_entropy_mask` runs on those entropies. The mask is a comparison, so it needs no gradient. Its
        entropies match the loss replay's to float rounding (~1e-6): a token's membership could differ from TRL's
        single-forward mask only if its entropy lies that close to the threshold."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        entropies = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        start = time.perf_counter()
        for g in range(len(inputs["longstraw_prompts"])):
            rows = rows_of[g]
            length = max(lengths[i] for i in rows) if rows else 0
            if length == 0:
                continue
            entry = self._loss_entry(entries, inputs, g, rows, lengths, loss_mask)
            with self._no_grad_context(self.model):
                _, h = entry.state.logprobs(
                    self.model,
                    completion_ids[rows, :length],
                    completion_mask[rows, :length],
                    self.temperature,
                    return_entropy=True,
                )
            entropies[rows, :length] = h.to(entropies.device)
        self._metrics[self._mode]["longstraw/entropy_pass_seconds"].append(time.perf_counter() - start)
        return self.get_high_entropy_mask(entropies, loss_mask, 1 - self.top_entropy_quantile)

    def _entropy_control(self, mode: str, window_stats: torch.Tensor | None) -> None:
        """TRL's adaptive entropy controller at the end of a micro-batch (train mode only), with TRL's attributes
        (`entropy_coef`, `_last_world_entropy`, `_entropy_window_stats`, so TRL's checkpoints of it apply): the
        window's `[entropy sum, token count]` accumulate over micro-batches; at the optimizer-step boundary they are
        summed over processes and the coefficient is updated for the next step."""
        if self.use_adaptive_entropy and mode == "train":
            stats = window_stats.detach()
            self._entropy_window_stats = (
                stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            )
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                self.entropy_coef = adaptive_entropy_coef(
                    self.entropy_coef,
                    world_entropy,
                    entropy_target=self.args.entropy_target,
                    entropy_coef_delta=self.args.entropy_coef_delta,
                    entropy_coef_min=self.args.entropy_coef_min,
                    entropy_coef_max=self.args.entropy_coef_max,
                )
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _micro_batch_router_aux(
        self, model, entries: dict, completion_ids, completion_mask, rows_of: list[list[int]]
    ):
        """The router statistics of the whole micro-batch (graph-free), for TRL's load-balancing loss."""
        groups = []
        for g, entry in entries.items():
            stats = self._router_prompt_stats.get(entry.state)
            if stats is None:
                raise LongStrawError(
                    f"prompt {entry.key} has no router statistics: its state was captured without the trainer's "
                    "router hooks"
                )
            rows = rows_of[g]
            groups.append((entry.state, stats, completion_ids[rows], completion_mask[rows]))
        with self._no_grad_context(model):
            return prepare_micro_batch(self._router_aux, model, groups, self.args.capture_chunk_size)

    def _policy_replay_with_router_aux(
        self, model, state, aux, ids, mask, length: int, entropy_grad: bool = False
    ):
        """`_policy_replay` one position longer (`[last prompt token, completion]`: TRL routes every completion
        token under its mask), plus the response's differentiable share of the load-balancing loss."""
        ext_ids, router_mask, keep = replay_inputs(ids, mask, length)
        with self._router_aux.stash() as router_logits:
            logps, entropies = self._policy_replay(
                model, state, ext_ids[None], torch.ones_like(ext_ids)[None], entropy_grad=entropy_grad
            )
        return logps[0, :keep], entropies[0, :keep], aux.term(router_logits, router_mask)

    def _replay_batches(
        self, rows: list[int], lengths: dict[int, int], one_at_a_time: bool
    ) -> list[list[int]]:
        """`rows` (of one prompt group, in order; `lengths`: the positions each replays) cut into the batches replayed
        together under autograd: consecutive rows while the batch's padded tokens (rows x longest) stay within
        `replay_batch_tokens`. One row a batch
        when that is 0, with the router auxiliary loss (each of its replays runs one position longer), or with reverse
        block replay (each response is back-propagated block by block)."""
        budget = self.args.replay_batch_tokens
        if one_at_a_time or budget <= 0:
            return [[i] for i in rows]
        batches: list[list[int]] = []
        longest = 0
        for i in rows:
            length = lengths[i]
            if batches and (len(batches[-1]) + 1) * max(longest, length) <= budget:
                batches[-1].append(i)
                longest = max(longest, length)
            else:
                batches.append([i])
                longest = length
        return batches

    def _streamed_loss(self, model, inputs: dict[str, Any], backward: bool) -> torch.Tensor:
        """TRL's `_compute_loss` value for this micro-batch, computed (and back-propagated) one response at a time."""
        mode = self._mode
        spec = self.loss_spec
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        prompts = inputs["longstraw_prompts"]
        num_rows, width = completion_ids.shape
        row_group = inputs.get("longstraw_row_group")
        if row_group is None:  # whole groups, in order
            row_group = torch.arange(num_rows) // (num_rows // len(prompts))
        row_group = row_group.tolist()
        rows_of = [[i for i in range(num_rows) if row_group[i] == g] for g in range(len(prompts))]
        lengths = loss_lengths(loss_mask)
        entries: dict[int, CachedPrompt] = {}
        entropy_mask = None
        if spec.top_entropy_quantile < 1.0:
            entropy_mask = self._high_entropy_mask(entries, inputs, rows_of, lengths, loss_mask)
        ctx = batch_loss_context(
            spec,
            loss_mask,
            num_items_in_batch=inputs["num_items_in_batch"],
            num_processes=self.accelerator.num_processes,
            # eval: never read (TRL does not either), and unset before the first `train()`
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if mode == "train" else 1,
            training=mode == "train",
            entropy_mask=entropy_mask,
            # fixed for the whole accumulation window: the adaptive update happens at its end
            entropy_coef=applied_entropy_coef(
                self.entropy_coef,
                self._last_world_entropy,
                self.args.entropy_target,
                self.use_adaptive_entropy,
            ),
        )
        # the entropies carry a graph only where the bonus contributes to the gradient
        entropy_grad = backward and spec.entropy_bonus_enabled and ctx.entropy_coef != 0.0
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
        ddp = backward and self.accelerator.num_processes > 1
        if ddp:
            with_tokens = [i for i in range(num_rows) if ctx.lengths[i] > 0]
            sync_row = max(with_tokens, key=lambda i: ctx.lengths[i]) if with_tokens else 0
            group_order.remove(row_group[sync_row])
            group_order.append(row_group[sync_row])
        # The full gradient: each group's replays accumulate its prompt state's gradient, then its prompt backward
        # carries it into the prompt's tokens. Under DDP every backward runs under `no_sync` but the last segment
        # of the last group's prompt backward, which touches every parameter.
        full = backward and self.args.gradient_mode == "full"
        blocks = backward and self.args.replay_block_size is not None
        if full:
            sync_row = None

        def cut(x, i, length):
            return None if x is None else x[i, :length]

        total = torch.zeros((), device=self.accelerator.device)
        all_metrics = []
        replay_seconds, replay_tokens = 0.0, 0
        aux = None
        if self._router_aux is not None:  # every state first: the router statistics span the micro-batch
            for g in group_order:
                self._loss_entry(entries, inputs, g, rows_of[g], lengths, loss_mask)
            aux = self._micro_batch_router_aux(model, entries, completion_ids, completion_mask, rows_of)
            total = total + spec.router_aux_loss_coef * aux.constant() / ctx.ga_normalizer
        no_sync = (lambda: self.accelerator.no_sync(model)) if ddp else None
        for g in group_order:
            entry = self._loss_entry(entries, inputs, g, rows_of[g], lengths, loss_mask)
            grads = StateGrads(entry.state) if full else None
            rows = list(rows_of[g])
            if sync_row in rows:  # the synchronising response runs last
                rows.remove(sync_row)
                rows.append(sync_row)
            replayed = []
            for i in rows:
                if ctx.lengths[i] == 0 and i != sync_row and aux is None:
                    # No loss token: its term is exactly zero (TRL's sums multiply it by the mask); no replay.
                    zeros = torch.zeros(1, device=device)
                    term, metrics = response_loss(
                        spec, ctx, i, zeros, cut(old, i, 1), cut(ref, i, 1), advantages[i], entropies_i=zeros
                    )
                    all_metrics.append(metrics)
                    total = total + term.detach()
                    continue
                replayed.append(i)
            # a 1-token replay skips the decoder layers, whose parameters DDP expects: the sync row replays >= 2
            replay_length = {
                i: max(ctx.lengths[i], min(2, width)) if i == sync_row else ctx.lengths[i] for i in replayed
            }
            for batch in self._replay_batches(replayed, replay_length, aux is not None or blocks):
                lengths_b = [replay_length[i] for i in batch]
                sync = (
                    self.accelerator.no_sync(model)
                    if (sync_row is not None and sync_row not in batch) or (full and ddp)
                    else _NULL_CONTEXT
                )
                start = time.perf_counter()
                with sync:
                    # reverse block replay: one response a batch (`_replay_batches`), its blocks back-propagated in turn
                    if blocks:
                        (i,), (length,) = batch, lengths_b
                        term, metrics = self._block_replay_term(
                            model, entry, inputs, ctx, i, g, length, entropy_grad, grads, sync_row == i
                        )
                        replay_seconds += time.perf_counter() - start
                        replay_tokens += length
                        total = total + term
                        all_metrics.append(metrics)
                        continue
                    if aux is None:
                        longest = max(lengths_b)
                        logps_b, entropies_b = self._policy_replay(
                            model,
                            entry.state,
                            completion_ids[batch, :longest],
                            completion_mask[batch, :longest],
                            entropy_grad=entropy_grad,
                            grads=grads,
                        )
                    batch_term = None
                    for j, (i, length) in enumerate(zip(batch, lengths_b, strict=True)):
                        if aux is None:
                            logps, entropies = logps_b[j, :length], entropies_b[j, :length]
                        else:
                            logps, entropies, aux_term = self._policy_replay_with_router_aux(
                                model,
                                entry.state,
                                aux,
                                completion_ids[i],
                                completion_mask[i],
                                length,
                                entropy_grad,
                            )
                            length = max(length, 1)  # a row without completion tokens still routes its prompt
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
                        if aux is not None:
                            term = term + spec.router_aux_loss_coef * aux_term / ctx.ga_normalizer
                        batch_term = term if batch_term is None else batch_term + term
                        replay_tokens += length
                        total = total + term.detach()
                        all_metrics.append(metrics)
                    if backward:
                        self.accelerator.backward(batch_term)
                replay_seconds += time.perf_counter() - start
                del logps, entropies, term, batch_term
                if aux is None:
                    del logps_b, entropies_b
            if full:
                start = time.perf_counter()
                last = ddp and g == group_order[-1]
                if last and entry.state.resident_tokens == 0:
                    raise LongStrawError(
                        "gradient_mode='full' under DDP needs the last prompt of a micro-batch to have more than one "
                        "token (its prompt backward synchronises the gradients)."
                    )
                with self._segment_context(model):
                    prompt_backward(
                        entry.state,
                        model,
                        grads,
                        checkpoint_layers=self._segment_checkpoint_layers,
                        no_sync=no_sync,
                        sync_last=last,
                    )
                self._metrics[mode]["longstraw/prompt_backward_seconds"].append(time.perf_counter() - start)
                del grads

        for name, value in aggregate_metrics(
            spec,
            all_metrics,
            reduce_sum=lambda t: self.accelerator.reduce(t, reduction="sum"),
            gather=self.accelerator.gather,
        ).items():
            self._metrics[mode][name].append(value)
        if spec.entropy_bonus_enabled:
            self._entropy_control(mode, torch.stack([m.bonus_entropy for m in all_metrics]).sum(0))
        if aux is not None:  # TRL: `gather_for_metrics(aux_loss).mean()`, before the coefficient
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux.value()).mean().item()
            )
        self._metrics[mode]["longstraw/replay_seconds"].append(replay_seconds)
        self._metrics[mode]["longstraw/replay_tokens_per_second"].append(
            replay_tokens / max(replay_seconds, 1e-9)
        )
        return total

    def _block_replay_term(self, model, entry, inputs, ctx, i, g, length, entropy_grad, grads, sync):
        """Response `i` by reverse block replay: its loss term (detached, back-propagated) and metrics."""
        spec = self.loss_spec
        old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
        sampling, advantages = inputs.get("sampling_per_token_logps"), inputs["advantages"]
        ids = inputs["completion_ids"][i : i + 1, :length]
        kept = {}

        def cut(x):
            return None if x is None else x[i, :length]

        def loss_term(logps, entropies):
            term, metrics = response_loss(
                spec,
                ctx,
                i,
                logps,
                cut(old),
                cut(ref),
                advantages[i],
                sampling_logps_i=cut(sampling),
                entropies_i=entropies,
            )
            if not torch.isfinite(term.detach()):
                self._raise_non_finite(term, i, g, entry, length, logps, old, ref, advantages)
            kept.setdefault("metrics", metrics)  # the first block's: every block sees the same values
            return term * 0.0 if ctx.lengths[i] == 0 else term

        _, _, term = self._block_replay_backward(
            model, entry.state, ids, loss_term, entropy_grad, grads, sync
        )
        return term, kept["metrics"]

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

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """TRL's `evaluate()`; the eval micro-batches must hold whole groups of `num_generations_eval` completions
        (checked here too: the config checks it only when an `eval_strategy` is set)."""
        check_whole_groups(
            self.args.per_device_eval_batch_size,
            self.num_generations_eval,
            "per_device_eval_batch_size",
            "num_generations_eval",
        )
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            _check_prompt_column(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._flush_step_counts("eval")
            # evaluation states are not kept (the training batch's are)
            self.prompt_cache.drop(self.prompt_cache.pinned - self._train_keys)
            self.prompt_cache.pin(self._train_keys)

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
