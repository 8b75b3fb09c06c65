"""`LongStrawGRPOTrainer`: TRL's `GRPOTrainer` with the prompt captured once per group and the loss streamed per response.

What it changes compared to `GRPOTrainer` (capture, generation, scoring and the streamed loss on prompt states; the
hooks it overrides; what it refuses at construction; the pre-flight plan) is described in docs/trainer.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils.memory import clear_device_cache
from peft import PeftModel
from torch import nn
from transformers.generation.utils import GenerationMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from .adapters import adapters_in_model_dtype, bind_autocast_lora_inputs, bind_expert_adapters
from .agents import grouped_rollout_func
from .checkpoint import REFRESH_STATE_FILE, load_refresh_record, save_refresh_record, warn_resume_inside_batch
from .checks import (
    check_datasets,
    check_launch,
    check_peft_config,
    check_prompt_column,
    check_prompt_positions,
    check_prompts,
    check_router_aux,
    check_supported,
)
from .config import LongStrawGRPOConfig, check_whole_groups
from .context_parallel import new_cp_groups
from .engine import checkpointing_off
from .errors import (
    LongStrawError,
    LongStrawTrainingError,
    NonFiniteLossError,
    RewardFunctionError,
)
from .expert_parallel import ExpertParallel, check_expert_parallel
from .fsdp import fit_fsdp_wrap_classes, is_fsdp2, stage_on_host_for_fsdp2
from .fused_forwards import fused_elementwise_forwards, replay_forwards
from .generation import SamplingParams
from .host_memory import DeviceShare
from .kernels.runtime.autotune import use_kernel_cache
from .kernels.runtime.compile_ahead import start_compile_ahead_here
from .loss import GRPOLossSpec, adaptive_entropy_coef, applied_entropy_coef
from .model_patches import patch_model, unwrap_model
from .options import CaptureOptions, LossOptions
from .parallel_dims import ParallelDims
from .positions import PositionLimit
from .preflight import StepPreflight
from .prompt_state_manager import PromptStateManager, peak_memory_gib
from .refresh import RefreshPolicy
from .rewards import named_reward_function, short_repr
from .rollout import Rollout
from .router_aux import RouterLoadBalancing
from .streamed_loss import LossScaling, StreamedLoss, split_by_groups

__all__ = [
    "REFRESH_STATE_FILE",
    "LongStrawGRPOConfig",
    "LongStrawGRPOTrainer",
    "LongStrawTrainingError",
    "NonFiniteLossError",
    "RewardFunctionError",
]

logger = logging.getLogger(__name__)

# TRL 1.16 switches activation checkpointing off around its log-prob passes through transformers' deprecated names
# (`is_gradient_checkpointing`, `gradient_checkpointing_disable` / `_enable`, in trl/models/utils.py), which
# transformers >= 5.23 answers with a FutureWarning on every run. The calls are TRL's and do what the new names do.
_TRL_CHECKPOINTING_ALIASES = (
    r"`(is_gradient_checkpointing|gradient_checkpointing_(enable|disable))` is deprecated"
)


@contextlib.contextmanager
def _trl_checkpointing_aliases_quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRL_CHECKPOINTING_ALIASES, category=FutureWarning)
        yield


# transformers' own `generate`, to tell it from a replacement (`_generate_is_injected`)
_TRANSFORMERS_GENERATE = GenerationMixin.generate


def _check_model(model) -> None:
    """`patch_model` the policy (or the reference); refuse prompt-learning PEFT."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict):
        for name, cfg in peft_config.items():
            check_peft_config(cfg, name)
    _bind_expert_adapters(model)
    bind_autocast_lora_inputs(model)  # PEFT's fp32 input copies under autocast (bit-exact without them)
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
    `capture_peak_memory_gib`, the same when the step's captures end; with `gradient_mode="full"`
    `peak_before_prompt_backward_gib`, the same before each group's prompt backward, and `prompt_backward_seconds`),
    `capture_seconds`,
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
        args = self._checked_args(model, args)
        check_supported(args, processing_class)
        check_datasets({"train_dataset": train_dataset, "eval_dataset": eval_dataset}, environment_factory)
        check_peft_config(peft_config)
        if not isinstance(model, str):
            _check_model(model)  # before TRL loads a reference model or builds anything else
        self._start_kernel_cache(args)

        # Set before `super().__init__` (TRL's `__init__` may already call overridden methods).
        self.cp_group = None
        self.expert_parallel: ExpertParallel | None = None
        self.prompt_states: PromptStateManager | None = None  # built once TRL's __init__ has set the model up

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
        self._check_runtime(args)
        self.parallel_dims = ParallelDims.from_launch(self.accelerator.state, args.cp_size, args.ep_size)
        self.cp_group = new_cp_groups(self.parallel_dims.cp)
        self.expert_parallel = self._shard_experts(args)
        self._prepare_fsdp()
        self._build_step(args)
        self._check_positions({"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        (logger.info if args.gradient_mode.full else logger.warning)(
            "LongStrawGRPOTrainer objective: %s", args.gradient_mode.objective()
        )
        if self.rollout_func is not None:
            self.rollout_func = grouped_rollout_func(self.rollout_func)
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names, strict=True)):
            if not isinstance(func, nn.Module):
                self.reward_funcs[i] = named_reward_function(func, name)

    @staticmethod
    def _checked_args(model, args: LongStrawGRPOConfig | None) -> LongStrawGRPOConfig:
        """``args``, or TRL's default config for ``model`` when ``None``; anything but a LongStrawGRPOConfig is
        refused."""
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            return LongStrawGRPOConfig(f"{str(name).split('/')[-1]}-LongStraw-GRPO")
        if not isinstance(args, LongStrawGRPOConfig):
            raise TypeError(
                f"args must be a LongStrawGRPOConfig (got {type(args).__name__}); it takes every GRPOConfig field, "
                "e.g. LongStrawGRPOConfig(**your_grpo_kwargs)."
            )
        return args

    @staticmethod
    def _start_kernel_cache(args: LongStrawGRPOConfig) -> None:
        """Point Triton at ``kernel_cache_dir`` and, with ``compile_ahead``, start compiling this GPU's recorded
        kernels in worker processes (once per process), so that they compile while TRL sets up."""
        kernel_cache = use_kernel_cache(args.kernel_cache_dir)
        if args.compile_ahead:
            start_compile_ahead_here(args.kernel_cache_dir)
        if torch.cuda.is_available():
            logger.info(
                "Triton kernel cache: %s (an empty cache makes the first step compile and autotune the GPU kernels, "
                "~100 s on an H200; a restarted job that finds it again skips that)",
                kernel_cache or "Triton's default, ~/.triton/cache",
            )

    def _check_runtime(self, args: LongStrawGRPOConfig) -> None:
        """The checks that need TRL's set-up: the launch, the models, the loss options (`loss_spec`, with the
        model's effective router aux-loss coefficient) and the router loss."""
        check_launch(self.accelerator.state)
        _check_model(self.model)
        if self.ref_model is not None:
            _check_model(self.ref_model)
        self.loss_spec = GRPOLossSpec.from_args(args, model=unwrap_model(self.model))
        check_router_aux(args, self.loss_spec.router_aux_loss_coef)

    def _prepare_fsdp(self) -> None:
        """Under Accelerate's FSDP2: wrap the model's own layer classes, and stage a model too large to wrap beside
        its shards on the host first."""
        if not self.parallel_dims.fsdp:
            return
        dropped = fit_fsdp_wrap_classes(getattr(self.accelerator.state, "fsdp_plugin", None), self.model)
        if dropped:
            logger.info("FSDP2 wraps the model's own layer classes; absent from this model: %s", dropped)
        staged = stage_on_host_for_fsdp2(self.model, self.parallel_dims.dp_shard)
        if staged:
            logger.warning(
                "FSDP2: the model's %.1f GiB on the GPU leave no room for its shards beside them while Accelerate "
                "wraps it, so it was moved to the host first; FSDP2 moves only this rank's shards back "
                "(load the model on the CPU to skip the round trip, docs/fsdp.md)",
                staged / 2**30,
            )

    def _build_step(self, args: LongStrawGRPOConfig) -> None:
        """The step's parts, each given its options once: the refresh policy, the prompt states, the rollout and
        the streamed loss."""
        # MoE load-balancing loss (longstraw_trl.router_aux): the routers
        self.router_aux = (
            RouterLoadBalancing(self.model) if self.loss_spec.router_aux_loss_coef != 0.0 else None
        )
        self.refresh_policy = RefreshPolicy(
            args.refresh_policy,
            args.refresh_interval,
            args.refresh_drift_threshold,
            args.refresh_probe_period,
            args.refresh_max_interval,
        )
        cache_bytes = None if args.prompt_cache_gib is None else int(args.prompt_cache_gib * 2**30)
        self.prompt_states = PromptStateManager(
            self,
            self.model,
            CaptureOptions.from_config(args, self.cp_group),
            self.refresh_policy,
            cache_bytes,
            self.router_aux,
        )
        self.rollout = Rollout(
            self,
            self.prompt_states,
            self._sampling_params(),
            self.eos_token_ids,
            getattr(self, "pad_to_multiple_of", None),
            self.temperature,
            None if args.generation_fsdp_gather_gib is None else int(args.generation_fsdp_gather_gib * 2**30),
            PositionLimit.of(self.model),
        )
        fsdp_size = self.parallel_dims.world if self.parallel_dims.fsdp else 0
        self.preflight = StepPreflight(self.model, args, self.accelerator.device, fsdp_size)
        self.streamed_loss = StreamedLoss(
            self.loss_spec,
            LossOptions.from_config(args, self.temperature),
            self,
            self.prompt_states,
            self.accelerator,
            self.router_aux,
            self.get_high_entropy_mask,
        )

    def _check_positions(self, datasets: dict[str, Any]) -> None:
        """Every prompt of the datasets, tokenised once as TRL tokenises it, plus `max_completion_length` against
        the model's positions, naming the rows (an environment renders its prompts itself: they are checked before
        their capture, `Rollout.check_positions`)."""
        if self.environment_factories is not None:
            return
        tokenize = lambda prompts: super(LongStrawGRPOTrainer, self)._tokenize_prompts(prompts)[0]  # noqa: E731
        for name, dataset in datasets.items():
            limit = self.rollout.position_limit
            check_prompt_positions(dataset, name, tokenize, self.max_completion_length, limit)

    def _plan_before_capture(self, prompt_ids: list, num_generations: int) -> None:
        """Before this call's captures: its prompts against the model's positions, then the pre-flight plan of its
        groups (`longstraw_trl.preflight`): where their states live (`offload_prompt_state="auto"`), or a
        `PreflightError` when nothing fits."""
        where = f"this generation batch (global step {self.state.global_step})"
        self.rollout.check_positions([len(ids) for ids in prompt_ids], where)
        groups = self.prompt_states.group_rows(prompt_ids, num_generations)
        offload = self.preflight.before_capture([len(ids) for ids in groups], num_generations)
        options, settings = self.prompt_states.options, self.preflight.settings
        chunk = (
            {"capture_chunk_size": settings["capture_chunk_size"]} if "capture_chunk_size" in settings else {}
        )
        self.prompt_states.options = dataclasses.replace(options, offload_prompt_state=offload, **chunk)
        # the "auto" settings the plan chose (the loss's: replay batching, prompt-backward checkpointing, chunk)
        self.streamed_loss.options = dataclasses.replace(self.streamed_loss.options, **settings)
        # one device share for the batch's captures: whole layers stay on the device within what the plan leaves
        share = self.preflight.device_state_bytes if offload == "cpu" else 0
        self.prompt_states.device_share = DeviceShare(share) if share else None

    def _sampling_params(self) -> SamplingParams:
        """TRL's sampling settings, as the shared-prefix sampler takes them."""
        return SamplingParams.from_settings(
            self.generation_kwargs,
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            do_sample=True,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self._tokenizer.pad_token_id,
            repetition_penalty=self.repetition_penalty,
        )

    def _shard_experts(self, args) -> ExpertParallel | None:
        """``ep_size > 1``: split the policy's routed experts over EP groups with transformers' EP
        (:class:`~longstraw_trl.expert_parallel.ExpertParallel`) before DDP or FSDP2 wraps the model (at ``train()``): DDP
        then leaves the expert parameters alone (``_ddp_params_and_buffers_to_ignore``), FSDP2 too (Accelerate's
        ``ignored_modules``: ``fully_shard(..., ignored_params=...)``), and their gradients are averaged over their
        replicas before the gradient norm (:meth:`_clip_grad_norm`, :meth:`_get_grad_norm`). A reference copy
        (``beta > 0`` without adapters) keeps every expert."""
        if self.parallel_dims.ep == 1:
            return None
        base = unwrap_model(self.model)
        check_expert_parallel(base, args.ep_size, self.parallel_dims.world, fsdp=is_fsdp2(self.model))
        ep = ExpertParallel(base, args.ep_size, args.ep_implementation)
        self.model._ddp_params_and_buffers_to_ignore = ep.ignored_by_ddp(self.model)
        if self.parallel_dims.fsdp:
            ep.keep_out_of_fsdp(self.accelerator.state.fsdp_plugin, self.model)
        return ep

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """transformers' ``_save``, with the experts of an expert-parallel model (full fine-tuning, DDP) gathered
        first on every rank: transformers' own path lets only the writing rank in, whose gather of the expert
        DTensors then waits for ranks that never come (tests/test_trainer_ep.py). With adapters, transformers' path
        as is (only the adapters are written; the experts, frozen, are not gathered; not tested with EP); under
        FSDP2 Accelerate's state-dict settings apply."""
        if self.expert_parallel is None or state_dict is not None or is_fsdp2(self.model_wrapped):
            return super()._save(output_dir, state_dict=state_dict)
        if isinstance(self.accelerator.unwrap_model(self.model), PeftModel):
            return super()._save(output_dir, state_dict=state_dict)
        state_dict = self.expert_parallel.full_state_dict(
            unwrap_model(self.model), keep=self.args.should_save
        )
        if self.args.should_save:
            super()._save(output_dir, state_dict=state_dict)

    def _clip_grad_norm(self, model):
        """transformers' clipping (one norm per device mesh: the experts' DTensor gradients on the EP mesh), after
        the expert gradients are averaged over their replicas (``ep_size > 1``)."""
        if self.expert_parallel is not None:
            self.expert_parallel.reduce_gradients()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """As transformers'; without clipping (``max_grad_norm=0``) this is the step's first look at the gradients, so
        the expert gradients are averaged over their replicas here (:meth:`_clip_grad_norm` otherwise)."""
        if grad_norm is None and self.expert_parallel is not None:
            self.expert_parallel.reduce_gradients()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ------------------------------------------------------------------------------------------------------------------
    # What the GRPO step objects ask of their host (longstraw_trl.prompt_state_manager.StepHost)
    # ------------------------------------------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """``"train"`` or ``"eval"`` (the policy's mode)."""
        return "train" if self.model.training else "eval"

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def phase_metrics(self) -> dict[str, list[float]]:
        return self._metrics[self.phase]

    def graph_free(self, model, cast_adapters: bool = False):
        """No autograd, no activation checkpointing (nothing to recompute), the accelerator's autocast; with
        `cast_adapters` (capture, generation, extension: nothing is scored) adapters in the model's dtype and the
        fused norm / MLP kernels (`graph_free_fused_kernels`). Without it (scoring: old and reference log-probs,
        entropies, the refresh probe) the forwards the training replays run (`autograd_fused_kernels`: the fused
        norm / MLP kernels and the LoRA epilogue), so that old log-probs equal the first replay's, as in stock TRL."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(checkpointing_off(model))
        stack.enter_context(self.accelerator.autocast())
        enabled = cast_adapters and self.args.graph_free_adapters_in_model_dtype
        stack.enter_context(adapters_in_model_dtype(model, enabled))
        if cast_adapters:
            stack.enter_context(fused_elementwise_forwards(model, self.args.graph_free_fused_kernels))
        else:
            stack.enter_context(replay_forwards(model, self.args.autograd_fused_kernels))
        return stack

    @property
    def prompt_cache(self):
        """The prompt-state cache (:class:`~longstraw_trl.state_cache.PromptStateCache`)."""
        return self.prompt_states.cache if self.prompt_states is not None else None

    def free_prompt_states(self) -> None:
        """Drop every captured prompt state (they are re-captured when needed)."""
        if self.prompt_states is not None:
            self.prompt_states.free()

    def live_state_bytes(self) -> int:
        """Bytes of the prompt states held (forks' shared pages counted once)."""
        return self.prompt_states.nbytes() if self.prompt_states is not None else 0

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
        for j, ids in enumerate(prompt_ids):
            if len(ids) == 0:
                row = index.index(j)
                raise LongStrawError(
                    f"row {row} of this batch (global step {self.state.global_step}): column 'prompt' "
                    f"({short_repr(unique[j])}) tokenizes to no token. Every row needs a non-empty prompt; drop the row, "
                    "e.g. dataset.filter(lambda row: bool(row['prompt']))."
                )
        return [prompt_ids[j] for j in index], None, {}

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if images is not None or multimodal_fields:
            raise LongStrawError("LongStrawGRPOTrainer does not support images in prompts; use text prompts.")
        tool_turn = self.prompt_states.tool_turn_keys is not None  # TRL's tool loop: one row per rollout
        if not tool_turn:
            self._plan_before_capture(prompt_ids, num_generations)
        if self._generate_is_injected():
            # stock's generation call draws the tokens; each group's prompt state is still acquired for the
            # old/reference log-probs and the loss
            if not getattr(self, "_warned_injected_generate", False):
                self._warned_injected_generate = True
                logger.warning(
                    "model.generate was replaced (on the model or on transformers' GenerationMixin): completions are "
                    "drawn through it, as stock GRPOTrainer does, not from the captured prompt state (slower on long "
                    "prompts). The loss still replays them on the captured state."
                )
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
            if not tool_turn:
                self.rollout.adopt_groups(prompt_ids, num_generations, completion_ids)
            return completion_ids, logprobs
        if tool_turn:  # never a loss group
            return self.rollout.tool_turn(prompt_ids), None
        return self.rollout.generate_groups(prompt_ids, num_generations), None

    def _generate_is_injected(self) -> bool:
        """Whether `generate` was replaced, on the model instance (`patch.object(trainer.model, "generate", ...)`) or on
        transformers' `GenerationMixin` (`patch("transformers.generation.utils.GenerationMixin.generate")`): how TRL's
        own tests script completions and tool calls. The trainer then honours it (see `_generate_single_turn`); a
        model class's own `generate` (e.g. PEFT's wrapper) is not a replacement."""
        own = vars(self.model).get("generate")
        # a method bound to the model itself (a wrapper a launcher such as Accelerate's FSDP2 set up) is not a script
        replaced = own is not None and getattr(own, "__self__", None) is not self.model
        return replaced or GenerationMixin.generate is not _TRANSFORMERS_GENERATE

    def _tool_call_loop(self, *args, **kwargs):
        """TRL's tool loop; its generation calls extend each rollout's own state (`Rollout.tool_turn`)."""
        with self.prompt_states.tool_turns():
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
        part is used: the prompt of each group is its captured state (the reference gets its own capture). Called
        outside a generation batch (no prompt states to replay on), it is TRL's own full-sequence method on these ids.
        """
        if self.prompt_states.batch_groups is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs
            )
        if kwargs.get("compute_aux_loss"):
            raise LongStrawError(
                "TRL's full-sequence MoE aux-loss path is not used here: the trainer streams the load-balancing loss "
                "per response (longstraw_trl.streamed_loss, longstraw_trl.router_aux)"
            )
        ids, mask = input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:]
        reference = self._is_reference_call(model)
        return self.prompt_states.batch_logprobs(model, ids, mask, self.temperature, reference), None, None

    def _generate_and_score_completions(self, inputs):
        # with an environment the prompt may come from its `reset()` alone (TRL defaults it to an empty user message)
        if inputs and "prompt" not in inputs[0] and self.environment_factories is None:
            raise LongStrawError(
                f"the dataset rows have no 'prompt' field (fields: {', '.join(inputs[0]) or 'none'}). "
                "LongStrawGRPOTrainer needs one prompt per row in a column named 'prompt'."
            )
        if self.cp_group is not None:
            # every rank of a context-parallel group works on its first rank's prompts
            box = [inputs]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.cp_group, 0), group=self.cp_group)
            inputs = box[0]
        with self.prompt_states.generation_batch() as groups:
            output = super()._generate_and_score_completions(inputs)
        # The prompt states stand for the (B, P) prompt tensors: keep each group's token ids once, on the CPU.
        output.pop("prompt_ids", None)
        output.pop("prompt_mask", None)
        output["longstraw_prompts"] = [(key, self.prompt_states[key].prompt_ids) for key in groups]
        return output

    def _split_by_groups(self, batch: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
        """`split_by_groups` in a random group order (the same on every rank of a context-parallel group)."""
        order = torch.randperm(len(batch["longstraw_prompts"])).tolist()
        if self.cp_group is not None:  # the ranks of a CP group must replay the same responses in step
            box = [order]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.cp_group, 0), group=self.cp_group)
            order = box[0]
        return split_by_groups(batch, num_chunks, order)

    def _prepare_inputs(self, generation_batch):
        if self.phase == "train":
            generate_every = self.args.steps_per_generation * self.num_iterations
            if self._step % generate_every == 0 or self._buffered_inputs is None:
                batch = self._generate_and_score_completions(generation_batch)
                self._buffered_inputs = self._split_by_groups(batch, self.args.steps_per_generation)
            return self._buffered_inputs[self._step % self.args.steps_per_generation]
        return self._generate_and_score_completions(generation_batch)

    # ------------------------------------------------------------------------------------------------------------------
    # The policy loss, one response at a time
    # ------------------------------------------------------------------------------------------------------------------
    def entropy_control(self, phase: str, window_stats: torch.Tensor | None) -> None:
        """TRL's adaptive entropy controller at the end of a micro-batch (train mode only), with TRL's attributes
        (`entropy_coef`, `_last_world_entropy`, `_entropy_window_stats`, so TRL's checkpoints of it apply): the
        window's `[entropy sum, token count]` accumulate over micro-batches; at the optimizer-step boundary they are
        summed over processes and the coefficient is updated for the next step."""
        if self.use_adaptive_entropy and phase == "train":
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
        if phase == "train" and self.accelerator.sync_gradients:
            self._metrics[phase]["entropy_coef"].append(self.entropy_coef)

    def micro_batch_loss(self, model, inputs: dict[str, Any], backward: bool) -> torch.Tensor:
        """TRL's `_compute_loss` value for this micro-batch, computed (and, with `backward`, back-propagated) one
        response at a time (`longstraw_trl.streamed_loss`); then TRL's adaptive entropy control."""
        phase = self.phase
        training = phase == "train"
        scaling = LossScaling(
            # eval: never read (TRL does not either), and unset before the first `train()`
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if training else 1,
            training=training,
            # fixed for the whole accumulation window: the adaptive update happens at its end
            entropy_coef=applied_entropy_coef(
                self.entropy_coef,
                self._last_world_entropy,
                self.args.entropy_target,
                self.use_adaptive_entropy,
            ),
            micro_step=self._step,
            global_step=self.state.global_step,
        )
        total, bonus_entropy = self.streamed_loss(model, inputs, backward, scaling)
        if bonus_entropy is not None:
            self.entropy_control(phase, bonus_entropy)
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch loss without back-propagation (evaluation); training goes through `training_step`."""
        if return_outputs:
            raise ValueError("LongStrawGRPOTrainer does not support returning outputs")
        return self.micro_batch_loss(model, inputs, backward=False)

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
            loss = self.micro_batch_loss(model, inputs, backward=True)
        del inputs
        if (
            self.args.torch_empty_cache_steps is not None
            and self.state.global_step % self.args.torch_empty_cache_steps == 0
        ):
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
            factories = self.environment_factories  # TRL's {None: factory} for a single one
            factory = factories[None] if factories is not None and list(factories) == [None] else factories
            check_prompt_column(eval_dataset, "eval_dataset", factory)
            check_prompts(eval_dataset, "eval_dataset")
        with _trl_checkpointing_aliases_quiet():
            return super().evaluate(
                eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
            )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._flush_step_counts("eval")
            self.prompt_states.end_eval()

    def _flush_step_counts(self, phase: str) -> None:
        metrics = self._metrics[phase]
        self.prompt_states.flush_counts(phase, metrics)
        peak = peak_memory_gib(self.accelerator.device)
        if peak is not None:
            metrics["longstraw/peak_memory_gib"].append(peak)

    # ------------------------------------------------------------------------------------------------------------------
    # Training entry point and checkpoints
    # ------------------------------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        try:
            with _trl_checkpointing_aliases_quiet():
                return super().train(*args, **kwargs)
        finally:
            self.free_prompt_states()
            self._buffered_inputs = None

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint plus the refresh policy's state and a record of the prompt states it leaves out
        (`longstraw_trl.checkpoint`; docs/guide.md, "Checkpoints and resuming")."""
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            save_refresh_record(
                folder, self.refresh_policy.state_dict(), self.prompt_states.checkpoint_summary()
            )

    def _load_optimizer_and_scheduler(self, checkpoint):
        """TRL's resume, then the refresh policy's state; the prompt states start empty (`PromptStateManager.resume`)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        record = load_refresh_record(checkpoint)
        if record is not None:
            self.refresh_policy.load_state_dict(record)
        self.prompt_states.resume(
            checkpoint, self.state.global_step, None if record is None else record.get("prompt_cache")
        )
        warn_resume_inside_batch(
            checkpoint,
            self.state.global_step,
            self.args.gradient_accumulation_steps,
            self.args.steps_per_generation,
            self.num_iterations,
        )
