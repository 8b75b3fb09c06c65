"""One training run of the ``real-long`` suite: stock ``GRPOTrainer`` or ``LongStrawGRPOTrainer`` (``full`` /
``response_only``) on the long-facts task, timed by phase, stopped cleanly at a deadline and resumed from its last
checkpoint by the next call.

A run lives in ``<runs>/<arm>_seed<seed>/``: TRL's checkpoints (``checkpoint-<step>``, the latest kept), ``clock.json``
(every finished step's seconds by phase and the peak memory, written with each checkpoint) and, once trained,
``final/`` (the LoRA adapter) when the held-out evaluation had to wait for the next call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import _long_facts as task  # noqa: E402
import grpo_lockers as demo  # noqa: E402
from _common import quiet_logs  # noqa: E402

ARMS = ("stock", "full", "response_only")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseClock(TrainerCallback):
    """Seconds of every optimizer step by phase: ``step`` (the whole step), ``document_capture`` (the documents
    captured before the step, LongStraw), ``generate_and_score`` (TRL's rollout: generation, rewards, LongStraw's
    prompt states), ``loss_and_backward`` (the rest of ``training_step``), ``optimizer``."""

    def __init__(self, steps: list[dict] | None = None):
        self.steps, self.current, self._t = list(steps or []), {}, {}

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def wrap(self, phase: str, fn):
        """``fn`` timed into ``phase`` (the device synchronised before and after)."""

        def timed(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                self.add(phase, time.perf_counter() - t0)

        return timed

    def _mark(self, key: str) -> None:
        sync()
        self._t[key] = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = {}
        self._mark("step")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._mark("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        sync()
        self.add("optimizer", time.perf_counter() - self._t["optimizer"])

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        step = self.current
        step["step"] = time.perf_counter() - self._t["step"]
        step["loss_and_backward"] = step.pop("training_step", 0.0) - step.get("generate_and_score", 0.0)
        self.steps.append(step)


class Deadline(TrainerCallback):
    """Stops training (with a checkpoint) when the next step would end past ``deadline`` (``time.monotonic()``), or
    after ``max_steps`` steps in this call (0: no such limit)."""

    def __init__(self, deadline: float, clock: PhaseClock, max_steps: int = 0):
        self.deadline, self.clock, self.max_steps = deadline, clock, max_steps
        self.done, self.stopped = 0, False

    def on_step_end(self, args, state, control, **kwargs):
        self.done += 1
        last = self.clock.steps[-1]["step"] if self.clock.steps else 0.0
        late = time.monotonic() + 1.5 * last > self.deadline
        if state.global_step < state.max_steps and (late or self.done == self.max_steps):
            control.should_training_stop = control.should_save = True
            self.stopped = True


class SaveClock(TrainerCallback):
    """Writes the clock's steps and the peak memory beside every checkpoint (``clock.json``)."""

    def __init__(self, run_dir: Path, clock: PhaseClock, peak: float):
        self.run_dir, self.clock, self.peak = run_dir, clock, peak

    def on_save(self, args, state, control, **kwargs):
        record = {"global_step": state.global_step, "steps": self.clock.steps[: state.global_step],
                  "peak_memory_gib": max(self.peak, peak_gib())}  # fmt: skip
        (self.run_dir / "clock.json").write_text(json.dumps(record))


class WarmDocuments(TrainerCallback):
    """Captures the bare documents of the coming step's questions into the prompt-state cache, so each question
    extends its document's state (examples/grpo_lockers.py's callback, with the task's tokenization: BOS first)."""

    def __init__(self, trainer, rows: list[dict], per_step: int, clock: PhaseClock):
        self.trainer, self.rows, self.per_step, self.clock = trainer, rows, per_step, clock

    def on_step_begin(self, args, state, control, **kwargs):
        start = state.global_step * self.per_step
        tokenizer = self.trainer.processing_class
        capture = self.clock.wrap("document_capture", self.trainer.prompt_cache.get)
        for doc in dict.fromkeys(r["doc"] for r in self.rows[start : start + self.per_step]):
            capture(torch.tensor(task.document_ids(tokenizer, doc)), state.global_step)


def peak_gib() -> float:
    """The device's peak allocated memory since the run's start (GPU), or the process's peak RSS (CPU), in GiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def grpo_kwargs(opts, seed: int, run_dir: Path) -> dict:
    """The GRPOConfig keywords of every arm: the demo's (examples/grpo_lockers.py), on this device, checkpointed."""
    demo_args = SimpleNamespace(
        output_dir=str(run_dir), seed=seed, num_generations=opts.num_generations,
        questions_per_step=opts.questions_per_step, completion_tokens=opts.completion_tokens,
        temperature=opts.temperature, steps=opts.steps, learning_rate=opts.learning_rate,
        no_activation_checkpointing=False,
    )  # fmt: skip
    cuda = opts.device == "cuda"
    return {
        **demo.grpo_arguments(demo_args),
        "use_cpu": not cuda,
        "bf16": cuda,  # TRL's default on a GPU: bf16 autocast over the fp32 weights
        "save_strategy": "steps",
        "save_steps": opts.save_steps,
        "save_total_limit": 1,
    }


def stock_batching(kwargs: dict, opts) -> dict:
    """Stock GRPOTrainer's batching at long prompts: ``--stock-rows-per-forward`` rows a training forward, accumulated
    to the step's rows (the same generation batch and optimizer step as the LongStraw arms; DAPO normalises over the
    whole batch), and a generation prefill of ``--stock-prefill-chunk`` tokens at a time (transformers'
    ``prefill_chunk_size``): Gemma-3's SDPA mask over the whole batch and prompt at once asks for 64 GiB at 16K."""
    rows = kwargs["per_device_train_batch_size"]
    micro = min(opts.stock_rows_per_forward, rows)
    if micro < 1 or rows % micro:
        raise SystemExit(
            f"--stock-rows-per-forward {opts.stock_rows_per_forward} must divide the step's {rows} rows"
        )
    chunk = {"prefill_chunk_size": opts.stock_prefill_chunk} if opts.stock_prefill_chunk else {}
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": rows // micro,
            "generation_kwargs": chunk or None}  # fmt: skip


def build_trainer(
    arm: str, opts, model, tokenizer, rows: list[dict], seed: int, run_dir: Path, clock: PhaseClock
):
    """The arm's trainer on ``rows`` (LoRA of rank ``opts.lora_rank`` on every linear layer), its phases timed."""
    from trl import GRPOConfig, GRPOTrainer

    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    lora_args = SimpleNamespace(lora_rank=opts.lora_rank)
    common = dict(model=model, reward_funcs=task.exact_reward, train_dataset=demo.train_dataset(rows),
                  processing_class=tokenizer, peft_config=demo.lora_config(lora_args))  # fmt: skip
    kwargs = grpo_kwargs(opts, seed, run_dir)
    if arm == "stock":
        trainer = GRPOTrainer(args=GRPOConfig(**{**kwargs, **stock_batching(kwargs, opts)}), **common)
    else:
        config = LongStrawGRPOConfig(**kwargs, gradient_mode=arm, refresh_policy="recapture")
        trainer = LongStrawGRPOTrainer(args=config, **common)
    quiet_logs(trainer)
    trainer.add_callback(clock)
    if arm != "stock":
        trainer.add_callback(WarmDocuments(trainer, rows, opts.questions_per_step, clock))
    trainer._generate_and_score_completions = clock.wrap(
        "generate_and_score", trainer._generate_and_score_completions
    )
    trainer.training_step = clock.wrap("training_step", trainer.training_step)
    return trainer


def train_rows(tokenizer, opts, seed: int) -> list[dict]:
    """The run's training questions: documents of seed ``1000 + seed`` (the held-out ones come from another)."""
    spec = task.TaskSpec(doc_tokens=opts.doc_tokens, questions_per_doc=opts.questions_per_doc)
    n_docs = -(-opts.steps * opts.questions_per_step // opts.questions_per_doc)
    return task.make_split(tokenizer, n_docs, spec, seed=1000 + seed)


def load_clock(run_dir: Path, checkpoint: str | None) -> tuple[list[dict], float]:
    """The steps timed up to ``checkpoint`` and the peak memory so far (nothing without a checkpoint)."""
    path = run_dir / "clock.json"
    if checkpoint is None or not path.is_file():
        return [], 0.0
    saved = json.loads(path.read_text())
    step = int(Path(checkpoint).name.split("-")[-1])
    return saved["steps"][:step], saved["peak_memory_gib"]


def train(arm: str, seed: int, opts, base, tokenizer, run_dir: Path, deadline: float):
    """Train (or go on training) one run until it ends or the deadline; returns the trainer, the clock, the peak
    memory and whether training finished."""
    import copy

    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = get_last_checkpoint(str(run_dir)) if any(run_dir.glob("checkpoint-*")) else None
    steps, peak = load_clock(run_dir, checkpoint)
    clock = PhaseClock(steps)
    torch.manual_seed(seed)  # the same LoRA initialisation in every arm
    rows = train_rows(tokenizer, opts, seed)
    trainer = build_trainer(arm, opts, copy.deepcopy(base), tokenizer, rows, seed, run_dir, clock)
    stop = Deadline(deadline, clock, opts.max_steps_per_call)
    trainer.add_callback(stop)
    trainer.add_callback(SaveClock(run_dir, clock, peak))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer, clock, max(peak, peak_gib()), not stop.stopped


def save_final(trainer, run_dir: Path) -> None:
    """The trained LoRA adapter, for an evaluation in the next call."""
    trainer.save_model(str(run_dir / "final"))


def load_final(base, run_dir: Path):
    """The base model with the run's trained adapter."""
    import copy

    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(run_dir / "final"))


def step_summary(steps: list[dict]) -> dict:
    """Mean seconds by phase over the steps after the first (warm-up), and the first step's."""
    later = steps[1:] or steps
    phases = sorted({k for s in steps for k in s})
    mean = {k: sum(s.get(k, 0.0) for s in later) / max(len(later), 1) for k in phases}
    return {"mean_after_first": mean, "first": steps[0] if steps else {}}


def logged_curves(trainer) -> dict:
    """The training reward of every step, the means of LongStraw's logged phase seconds and its prompt tokens
    captured and reused (a question extending its document's state)."""
    logs = [h for h in trainer.state.log_history if "reward" in h]
    keys = sorted({k for h in logs for k in h if k.startswith("longstraw/") and k.endswith("_seconds")})
    means = {k: sum(h.get(k) or 0.0 for h in logs) / max(len(logs), 1) for k in keys}
    tokens = {
        k: int(sum(h.get(f"longstraw/{k}") or 0 for h in logs)) for k in ("tokens_captured", "tokens_reused")
    }
    return {
        "reward_curve": [h["reward"] for h in logs],
        "longstraw_phase_seconds": means,
        "prompt_tokens": tokens,
    }


def remove_checkpoints(run_dir: Path) -> None:
    import shutil

    for path in run_dir.glob("checkpoint-*"):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(run_dir, exist_ok=True)
