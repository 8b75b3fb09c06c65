"""What `LongStrawGRPOTrainer` refuses at construction, beyond the config's own validation: options the trainer
cannot honour with this model, launch or data. Each check runs once, from the trainer, and each message says what
to change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from transformers import ProcessorMixin

from .config import LongStrawGRPOConfig
from .errors import LongStrawError, UnsupportedModelError
from .generation import SamplingParams
from .parallel_dims import launched_with_fsdp
from .positions import PositionLimit, check_prompt_lengths

__all__ = [
    "check_datasets",
    "check_launch",
    "check_peft_config",
    "check_prompt_column",
    "check_prompt_positions",
    "check_prompts",
    "check_router_aux",
    "check_supported",
]


def _refuse(what: str, fix: str) -> None:
    raise LongStrawError(f"LongStrawGRPOTrainer does not support {what}. {fix}")


def check_supported(args: LongStrawGRPOConfig, processing_class: Any = None) -> None:
    """Refuse what the trainer cannot honour with these options: generation backends and kwargs, parallel and
    optimizer set-ups, multimodal processors. Fails at construction, never trains on something else."""
    if args.use_vllm:
        _refuse(
            "use_vllm=True",
            "Completions are sampled from the captured prompt state (shared-prefix decoding), not by vLLM. Set "
            "use_vllm=False.",
        )
    if args.use_transformers_continuous_batching:
        _refuse("use_transformers_continuous_batching=True", "Set it to False.")
    SamplingParams.check_generation_kwargs(args.generation_kwargs)
    if args.max_completion_length is None:
        _refuse(
            "max_completion_length=None", "Set max_completion_length to the longest completion to sample."
        )
    if args.top_entropy_quantile < 1.0 and args.cp_size > 1:
        _refuse(
            f"top_entropy_quantile={args.top_entropy_quantile} with cp_size={args.cp_size}",
            "The entropy quantile is taken over the entropies gathered from every process, and the ranks of a "
            "context-parallel group hold the same responses (each would count cp_size times). Set cp_size=1 or "
            "top_entropy_quantile=1.0.",
        )
    _check_sharding(args)
    if str(args.optim).lower().endswith("lomo"):
        _refuse(
            f"optim={args.optim!r}",
            "LOMO optimizers update the weights inside backward(), but the loss is back-propagated one response "
            "at a time. Use another optimizer (e.g. adamw_torch).",
        )
    if isinstance(processing_class, ProcessorMixin):
        _refuse(
            "multimodal processors (images)",
            "Pass the tokenizer as processing_class and text (or chat) prompts only.",
        )


def _check_sharding(args: LongStrawGRPOConfig) -> None:
    if args.deepspeed:
        _refuse(
            "DeepSpeed",
            "The loss is back-propagated one response at a time under Accelerate's `no_sync` (FSDP2: "
            "`set_requires_gradient_sync(False)`), which DeepSpeed's engine does not offer outside its own "
            "gradient accumulation. Shard the policy with FSDP2 instead (`accelerate launch --config_file "
            "examples/accelerate/fsdp2.yaml`), or launch with plain DDP or a single process.",
        )
    fsdp_version = int((getattr(args, "fsdp_config", None) or {}).get("version", 2))
    if args.fsdp and fsdp_version != 2:
        _refuse(
            f"FSDP version {fsdp_version}",
            "Use FSDP2 (`fsdp_config={'version': 2}`, or `fsdp_version: 2` in the Accelerate config: "
            "examples/accelerate/fsdp2.yaml).",
        )


def check_router_aux(args: LongStrawGRPOConfig, router_aux_loss_coef: float) -> None:
    """Refuse a MoE router load-balancing loss (the model's effective coefficient) with the options that cannot
    stream it (context and expert parallelism can: tests/test_trainer_ep.py)."""
    if router_aux_loss_coef == 0.0:
        return
    # cp_size > 1 (and ep_size > 1) is fine: the routers are replicated and every rank of a CP group routes every
    # token of the batch it shares, so each computes the same statistics (docs/parallelism.md).
    if args.replay_block_size is not None:
        raise LongStrawError(
            "router_aux_loss_coef != 0 is not supported with replay_block_size (a response's router loss would "
            "need to be split over its blocks). Set router_aux_loss_coef=0.0 or replay_block_size=None."
        )


def check_launch(state: Any) -> None:
    """Refuse a launch (Accelerate's ``AcceleratorState``: the ``accelerate launch`` config) the trainer cannot
    run: FSDP other than FSDP2, and Accelerate's own context or tensor parallelism (``parallelism_config``).
    FSDP2 shards over every rank (``dp_shard_size``, with ``dp_replicate_size`` for HSDP), and LongStraw's
    ``cp_size`` groups consecutive ranks of the same world (docs/fsdp.md)."""
    plugin = getattr(state, "fsdp_plugin", None)
    if launched_with_fsdp(state) and plugin is not None and plugin.fsdp_version != 2:
        raise LongStrawError(
            f"LongStrawGRPOTrainer does not support FSDP version {plugin.fsdp_version}: set `fsdp_version: 2` "
            "in the Accelerate config (examples/accelerate/fsdp2.yaml)."
        )
    parallelism = getattr(state, "parallelism_config", None)
    if parallelism is not None and (parallelism.cp_size > 1 or parallelism.tp_size > 1):
        raise LongStrawError(
            f"Accelerate's parallelism_config cp_size={parallelism.cp_size}, tp_size={parallelism.tp_size}: "
            "Accelerate's context parallelism shards one training sequence (ring attention over SDPA) and its "
            "tensor parallelism is not wired into the engine. Set both to 1 there, and use "
            "LongStrawGRPOConfig.cp_size for context parallelism over prompt pages "
            "(examples/accelerate/fsdp2_cp8.yaml)."
        )


def check_peft_config(peft_config: Any, name: str | None = None) -> None:
    """Refuse a prompt-learning PEFT method (virtual tokens or prefix K/V), which the prompt state does not carry."""
    if peft_config is None or not getattr(peft_config, "is_prompt_learning", False):
        return
    kind = type(peft_config).__name__
    what = (
        f"PEFT adapter {name!r} ({kind}) is a prompt-learning method"
        if name
        else f"{kind} is a prompt-learning PEFT method"
    )
    raise UnsupportedModelError(
        f"{what} (virtual tokens or prefix K/V), which the prompt state does not carry. Use LoRA-style adapters."
    )


def _dataset_columns(dataset: Any) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict
        return None
    return list(names) if names is not None else None


def check_prompt_column(dataset: Any, name: str, environment_factory: Any = None) -> None:
    """A 'prompt' column, unless an environment owns the data (TRL 1.16: `reset()` gives the prompt; with a dict
    `environment_factory` an 'environment' column names each row's environment)."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for split, ds in dataset.items():
            check_prompt_column(ds, f"{name}[{split!r}]", environment_factory)
        return
    columns = _dataset_columns(dataset)
    if columns is None or "prompt" in columns:
        return
    if isinstance(environment_factory, dict) and "environment" not in columns:
        raise LongStrawError(
            f"{name} has neither a 'prompt' nor an 'environment' column (columns: {', '.join(columns) or 'none'}). "
            "With a dict environment_factory every row names its environment in a column 'environment' (one of "
            f"{list(environment_factory)}), whose reset() gives the prompt; or add a 'prompt' column."
        )
    if environment_factory is None:
        raise LongStrawError(
            f"{name} has no 'prompt' column (columns: {', '.join(columns) or 'none'}). LongStrawGRPOTrainer needs one "
            "prompt per row in a column named 'prompt': a string, or a list of chat messages (the chat template is "
            "then applied as in TRL). Rename your column, e.g. dataset.rename_column('text', 'prompt')."
        )


def _prompt_lengths(values: pa.Array) -> pa.Array | None:
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return pc.utf8_length(values)
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        return pc.list_value_length(values)
    return None


def check_prompts(dataset: Any, name: str, batch_size: int = 1024) -> None:
    """Refuse an empty prompt (``None``, ``""``, ``[]``) now, naming its row, where the dataset can be read without
    its strings (a map-style ``datasets.Dataset``: Arrow lengths, batch by batch); streamed datasets are checked at
    their first step (the trainer's `_tokenize_prompts`)."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for split, ds in dataset.items():
            check_prompts(ds, f"{name}[{split!r}]", batch_size)
        return
    if not (
        hasattr(dataset, "select_columns") and hasattr(dataset, "with_format") and hasattr(dataset, "__len__")
    ):
        return
    if "prompt" not in (_dataset_columns(dataset) or ()):
        return
    column = dataset.select_columns(["prompt"]).with_format("arrow")
    for start in range(0, len(column), batch_size):
        lengths = _prompt_lengths(column[start : start + batch_size]["prompt"])
        if lengths is None:
            return
        empty = pc.or_kleene(pc.is_null(lengths), pc.equal(lengths, 0))
        if pc.any(empty).as_py():
            row = start + pc.index(empty, True).as_py()
            raise LongStrawError(
                f"{name} row {row}: column 'prompt' is empty ({dataset[row]['prompt']!r}). Every row needs a prompt "
                "(a non-empty string, or a non-empty list of chat messages); drop the row, e.g. "
                "dataset.filter(lambda row: bool(row['prompt']))."
            )


def check_datasets(datasets: dict[str, Any], environment_factory: Any = None) -> None:
    """:func:`check_prompt_column` and :func:`check_prompts` on each named dataset (``None`` ones skipped)."""
    for name, dataset in datasets.items():
        check_prompt_column(dataset, name, environment_factory)
        check_prompts(dataset, name)


def check_prompt_positions(
    dataset: Any,
    name: str,
    tokenize: Callable[[list], list],
    max_completion_length: int,
    limit: PositionLimit,
    batch_size: int = 256,
) -> None:
    """Refuse now, naming the rows, prompts that with ``max_completion_length`` exceed the model's positions:
    every prompt of a map-style dataset tokenised once by ``tokenize`` (the trainer's: TRL's tokenisation, chat
    template included), batch by batch, on the CPU. Streamed datasets are checked batch by batch before their
    capture (``longstraw_trl.rollout``)."""
    if dataset is None or limit.limit is None:
        return
    if isinstance(dataset, dict):
        for split, ds in dataset.items():
            check_prompt_positions(
                ds, f"{name}[{split!r}]", tokenize, max_completion_length, limit, batch_size
            )
        return
    if not (hasattr(dataset, "select_columns") and hasattr(dataset, "__len__")):
        return
    if "prompt" not in (_dataset_columns(dataset) or ()):
        return
    column = dataset.select_columns(["prompt"])
    lengths = []
    for start in range(0, len(column), batch_size):
        prompts = column[start : start + batch_size]["prompt"]
        lengths += [(start + i, len(ids)) for i, ids in enumerate(tokenize(prompts))]
    check_prompt_lengths(lengths, max_completion_length, limit, name)
