"""Shared helpers for tests that need a real TRL `GRPOTrainer` (CPU, no downloads).

- `tiny_model_dir()`: a tiny random-init Qwen3 causal LM + the toy tokenizer, saved once per process to a temp dir
  (TRL builds its reference model from the policy's `name_or_path` when `beta != 0`, so the model must exist on
  disk).
- `make_tiny_grpo_trainer(loss_type=..., beta=..., **grpo_kwargs)`: a real `GRPOTrainer` on that model (~60 ms).
- `random_grpo_inputs(...)`: TRL-shaped `inputs` for `GRPOTrainer._compute_loss` with completions of different
  lengths, plus the log-probs/entropies to feed it.
- `patch_per_token_logps(trainer, logps, entropies)`: make `_compute_loss` see exactly these tensors.
- `trl_compute_loss(trainer, inputs, logps, entropies)`: run TRL's real `_compute_loss`, backprop, and return the
  value, the gradients and the metrics it logged.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import warnings
from functools import lru_cache
from typing import Any
from unittest import mock

import torch
import transformers
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from longstraw_trl.toy_tokenizer import build_toy_tokenizer

TINY_VOCAB = 64

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


def tiny_qwen3_config(vocab_size: int = TINY_VOCAB) -> Qwen3Config:
    """A 2-layer, hidden-32 Qwen3 config whose special token ids match the toy tokenizer."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


@lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """Directory holding a saved tiny random-init Qwen3 model and the toy tokenizer (created once per process)."""
    path = tempfile.mkdtemp(prefix="longstraw_tiny_qwen3_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config()).save_pretrained(path)
    build_toy_tokenizer(TINY_VOCAB).save_pretrained(path)
    return path


def _constant_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def _tiny_config_kwargs(prefix: str, loss_type: str, beta: float, **extra: Any) -> dict[str, Any]:
    """The (LongStraw)GRPOConfig keywords both tiny trainers start from: CPU, no logging integrations."""
    return dict(
        output_dir=tempfile.mkdtemp(prefix=prefix),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=16,
        activation_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        loss_type=loss_type,
        beta=beta,
        **extra,
    )


def tiny_qwen3_moe(router_aux_loss_coef: float = 0.3, seed: int = 0):
    """A 2-layer Qwen3-MoE twin of the tiny model (4 experts, top-2) with sharpened routers (random-init routers are
    near-uniform, which makes every load-balancing gradient tiny)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = tiny_qwen3_config()
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    same += ("num_key_value_heads", "head_dim", "max_position_embeddings", "pad_token_id", "bos_token_id")
    config = Qwen3MoeConfig(
        **{k: getattr(dense, k) for k in same},
        eos_token_id=dense.eos_token_id,
        tie_word_embeddings=False,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40.0)
    return model


def make_tiny_grpo_trainer(loss_type: str = "dapo", beta: float = 0.0, **grpo_kwargs: Any) -> GRPOTrainer:
    """A real `GRPOTrainer` on the tiny model, built on CPU without any download or logging integration.

    Defaults (each overridable through `grpo_kwargs`): `per_device_train_batch_size=4`, `num_generations=4`,
    `gradient_accumulation_steps=2`, `max_completion_length=16`, `report_to="none"`, `use_cpu=True`,
    `activation_checkpointing=False`, `save_strategy="no"`, `bf16=False`; `reward_funcs`, `callbacks`, `train_dataset` and
    `eval_dataset` go to the trainer. The
    model is in eval mode after construction (as TRL
    leaves it); call `trainer.model.train()` for train-mode loss scaling, and set
    `trainer.current_gradient_accumulation_steps` (normally set by the Trainer's training loop).
    """
    path = tiny_model_dir()
    reward_funcs = grpo_kwargs.pop("reward_funcs", _constant_reward)
    callbacks = grpo_kwargs.pop("callbacks", None)
    dataset = grpo_kwargs.pop("train_dataset", None)
    eval_dataset = grpo_kwargs.pop("eval_dataset", None)
    model = grpo_kwargs.pop("model", None)
    # fp32 like the LongStraw side: under GRPOConfig's default bf16=True the stock forward would run in CPU bf16
    # autocast, a looser reference than the fp32 it is compared with
    kwargs = _tiny_config_kwargs("longstraw_grpo_", loss_type, beta, bf16=False)
    kwargs.update(grpo_kwargs)
    atexit.register(shutil.rmtree, kwargs["output_dir"], ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(**kwargs)
        if model is None:
            model = Qwen3ForCausalLM.from_pretrained(path)
        tokenizer = build_toy_tokenizer(TINY_VOCAB)
        if dataset is None:
            dataset = Dataset.from_dict(
                {"prompt": ["hello world", "the cat sat", "on the mat", "long straw"]}
            )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def random_grpo_inputs(
    lengths: list[int],
    *,
    seed: int = 0,
    max_len: int | None = None,
    prompt_len: int = 3,
    beta: float = 0.0,
    with_old: bool = True,
    num_items_in_batch: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """TRL-shaped `_compute_loss` inputs for completions of the given lengths (right-padded to `max_len`).

    Returns `(inputs, per_token_logps, entropies)`. Log-probs are random but plausible (negative), with the current
    policy and the reference drawn around the old policy so that ratios fall on both sides of the clip range.
    Advantages alternate in sign. `num_items_in_batch` defaults to the local token count times 2 plus 3 (a
    generation batch larger than the micro-batch, as in TRL).
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    max_len = max_len or max(max(lengths), 1)
    completion_mask = (torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]).int()
    old = -torch.rand(batch, max_len, generator=gen, dtype=dtype) * 3 - 0.05
    logps = old + 0.35 * torch.randn(batch, max_len, generator=gen, dtype=dtype)
    logps = logps.clamp(max=-1e-3)
    entropies = torch.rand(batch, max_len, generator=gen, dtype=dtype) * 2
    advantages = torch.randn(batch, generator=gen, dtype=dtype).abs() + 0.1
    advantages[1::2] *= -1
    if num_items_in_batch is None:
        num_items_in_batch = int(completion_mask.sum()) * 2 + 3
    inputs = {
        "prompt_ids": torch.randint(4, TINY_VOCAB, (batch, prompt_len), generator=gen),
        "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(4, TINY_VOCAB, (batch, max_len), generator=gen) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(num_items_in_batch),
    }
    if with_old:
        inputs["old_per_token_logps"] = old
    if beta != 0.0:
        inputs["ref_per_token_logps"] = old + 0.25 * torch.randn(batch, max_len, generator=gen, dtype=dtype)
    return inputs, logps, entropies


def patch_per_token_logps(
    trainer: GRPOTrainer, logps: torch.Tensor, entropies: torch.Tensor | None = None
) -> None:
    """Make the trainer's `_get_per_token_logps_and_entropies` return exactly `(logps, entropies, None)`."""

    def fake(*args, **kwargs):
        return logps, entropies, None

    trainer._get_per_token_logps_and_entropies = fake


def trl_compute_loss(
    trainer: GRPOTrainer, inputs: dict[str, torch.Tensor], logps: torch.Tensor, entropies: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Run TRL's real `_compute_loss` on `inputs` with the given log-probs/entropies and back-propagate.

    Returns `(loss, grad_logps, grad_entropies, metrics)`: the detached loss, the gradients w.r.t. the log-probs
    and entropies, and the last value of every metric `_compute_loss` appended to `trainer._metrics[mode]`.
    """
    mode = "train" if trainer.model.training else "eval"
    logps_leaf = logps.detach().clone().requires_grad_()
    entropies_leaf = entropies.detach().clone().requires_grad_()
    patch_per_token_logps(trainer, logps_leaf, entropies_leaf)
    trainer._metrics[mode].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics[mode].items() if values}
    return loss.detach(), logps_leaf.grad, entropies_leaf.grad, metrics


# ----------------------------------------------------------------------------------------------------------------------
# LongStrawGRPOTrainer helpers (tests/test_trainer*.py)
# ----------------------------------------------------------------------------------------------------------------------
def make_tiny_longstraw_trainer(loss_type: str = "dapo", beta: float = 0.0, **kwargs: Any):
    """A `LongStrawGRPOTrainer` on the same tiny model, with `make_tiny_grpo_trainer`'s defaults.

    Extra keywords go to `LongStrawGRPOConfig`, except `train_dataset`, `eval_dataset`, `reward_funcs`, `model`,
    `peft_config` and `callbacks`.
    """
    from transformers.trainer_callback import PrinterCallback

    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    path = tiny_model_dir()
    dataset = kwargs.pop("train_dataset", None)
    if dataset is None:
        dataset = Dataset.from_dict({"prompt": ["hello world", "the cat sat", "on the mat", "long straw"]})
    reward_funcs = kwargs.pop("reward_funcs", _constant_reward)
    model = kwargs.pop("model", None)
    peft_config = kwargs.pop("peft_config", None)
    callbacks = kwargs.pop("callbacks", None)
    eval_dataset = kwargs.pop("eval_dataset", None)
    config = _tiny_config_kwargs("longstraw_trainer_", loss_type, beta, bf16=False, disable_tqdm=True)
    config.update(kwargs)
    atexit.register(shutil.rmtree, config["output_dir"], ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = LongStrawGRPOConfig(**config)
        if model is None:
            model = Qwen3ForCausalLM.from_pretrained(path)
        trainer = LongStrawGRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=build_toy_tokenizer(TINY_VOCAB),
            peft_config=peft_config,
            callbacks=callbacks,
        )
    # no log dicts on stdout: `pytest -s` shows the tests' own prints
    trainer.remove_callback(PrinterCallback)
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def patch_response_only_logps(trainer: GRPOTrainer, prompt_ids: torch.Tensor) -> None:  # noqa: C901
    """Make TRL's `_get_per_token_logps_and_entropies` compute the *response-only* log-probs on the stock model.

    The response-only reference of docs/design.md ("Correctness references"): `prompt[:P-1]` is prefilled into the stock HF cache under
    `no_grad`, then each completion row runs as `[prompt[P-1], completion[:-1]]` with autograd on a (rebinding)
    copy of that cache, so its token 0 is scored through every layer. `prompt_ids` is one prompt that every row
    shares (1-D), or one per row (`[B, P]`). TRL's `_compute_loss` then runs unchanged on these log-probs.
    When TRL asks for the MoE load-balancing loss (`compute_aux_loss`), it is transformers' own
    `load_balancing_loss_func` over the router logits of every row's `prompt + completion` under TRL's attention
    mask, the prompt's first P-1 tokens from the `no_grad` prefill (constants) and each row's last prompt token and
    completion tokens from its own run with autograd (which then runs `[prompt[P-1], completion]`, all R tokens).
    """
    from _reference import rebinding_copy

    def response_only(
        model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kw
    ):
        aux = bool(kw.get("compute_aux_loss"))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        completions = input_ids[:, -logits_to_keep:]
        per_row = prompt_ids.dim() == 2
        router = {"output_router_logits": True} if aux else {}
        prefills = {}
        logps, entropies, gate_logits = [], [], []
        for i in range(completions.size(0)):
            prompt = prompt_ids[i] if per_row else prompt_ids
            key = tuple(prompt.tolist())
            if key not in prefills:
                with torch.no_grad():
                    prefills[key] = base.model(prompt[None, :-1], use_cache=True, **router)
            prefill = prefills[key]
            row = completions[i : i + 1]
            tokens = torch.cat([prompt[None, -1:], row if aux else row[:, :-1]], dim=1)
            out = base.model(
                tokens,
                past_key_values=rebinding_copy(prefills[key].past_key_values),
                use_cache=True,
                **router,
            )
            h = out.last_hidden_state[:, : row.size(1)]
            logp = torch.log_softmax(base.lm_head(h).float() / trainer.temperature, dim=-1)
            logps.append(logp.gather(-1, row[..., None])[..., 0])
            entropies.append(-(logp.exp() * logp).sum(-1))
            if aux:
                gate_logits.append(
                    [torch.cat([p, r]) for p, r in zip(prefill.router_logits, out.router_logits, strict=True)]
                )
        aux_loss = None
        if aux:
            import sys

            lb = sys.modules[type(base).__module__].load_balancing_loss_func
            layers = tuple(torch.cat(per_layer) for per_layer in zip(*gate_logits, strict=True))
            aux_loss = lb(layers, base.num_experts, base.num_experts_per_tok, attention_mask)
        return torch.cat(logps), torch.cat(entropies), aux_loss

    trainer._get_per_token_logps_and_entropies = response_only


def assert_micro_batch_matches_stock(trl: GRPOTrainer, ours, inputs: dict, ours_inputs: dict) -> None:
    """One micro-batch in train mode: TRL's `_compute_loss` + backward against ours (`micro_batch_loss`, back-propagated
    per response) on the same rows: the loss to 1e-5 and every parameter gradient (`assert_grads_close`)."""
    from _reference import assert_grads_close, param_grads

    for t in (trl, ours):
        t.model.train()
        t.model.zero_grad()
    ref_loss = trl._compute_loss(trl.model, inputs)
    ref_loss.backward()
    loss = ours.micro_batch_loss(ours.model, ours_inputs, backward=True)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=0)
    assert_grads_close(param_grads(ours.model), param_grads(trl.model))


# ----------------------------------------------------------------------------------------------------------------------
# train() under TRL's defaults, stock GRPOTrainer and ours in gradient_mode="full", on the same scripted draws
# ----------------------------------------------------------------------------------------------------------------------
SCRIPTED = [[5, 9, 11, 2], [6, 12, 2], [7, 13, 14, 15, 2], [8, 2]]  # the G = 4 draws of every group (EOS = 2)
TRAIN_PROMPT = "the cat sat on the mat and the dog ran far away from it all"  # 59 toy tokens


def scripted_rows(n: int) -> torch.Tensor:
    """``n`` completions cycling through :data:`SCRIPTED`, right-padded with 0."""
    rows = [SCRIPTED[i % len(SCRIPTED)] for i in range(n)]
    out = torch.zeros(n, max(map(len, rows)), dtype=torch.long)  # pad 0
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def _length_reward(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


def scripted_trainer(
    stock: bool,
    peft_config=None,
    prompts=(TRAIN_PROMPT,) * 4,
    make_model=None,
    full_overrides: dict | None = None,
    draws=scripted_rows,
    install_draws: bool = True,
    **overrides: Any,
):
    """Stock GRPOTrainer (``stock``) or ours in ``gradient_mode="full"`` on a model from ``make_model()`` (default: the
    tiny Qwen3), with every group's draws scripted (:data:`SCRIPTED`), under TRL's defaults for HF gradient
    checkpointing (on) with plain SGD (an update is the gradient times the learning rate, so the weights compare the
    gradients). ``overrides`` replace the shared settings (fp32, 4 rows a device, 2 steps of 2 iterations, beta 0.04);
    ``full_overrides`` go to ours only. The draws (``draws(n)``: ``n`` right-padded rows)
    replace stock's ``model.generate`` and our ``Rollout.sample_group`` unless ``install_draws`` is False. Not trained
    yet."""
    from trl import GRPOConfig, GRPOTrainer

    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    if make_model is None:
        make_model = lambda: Qwen3ForCausalLM.from_pretrained(tiny_model_dir())  # noqa: E731
    settings = dict(
        report_to="none",
        use_cpu=True,
        bf16=False,  # the reference in fp32 (CPU autocast would make it a bf16 one)
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        num_iterations=2,
        beta=0.04,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=7,
    )
    settings.update(overrides)
    if stock:
        cls, config_cls = GRPOTrainer, GRPOConfig
    else:
        cls, config_cls = LongStrawGRPOTrainer, LongStrawGRPOConfig
        settings = {"gradient_mode": "full", "capture_chunk_size": 4, "page_size": 3, **settings}
        settings.update(full_overrides or {})
    out = tempfile.mkdtemp(prefix="longstraw_train_both_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    args = config_cls(output_dir=out, **settings)
    assert args.gradient_checkpointing  # TRL's default
    model = make_model()
    torch.manual_seed(11)  # the same LoRA initialisation on both sides
    trainer = cls(
        model=model,
        reward_funcs=_length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
        processing_class=build_toy_tokenizer(TINY_VOCAB),
        peft_config=peft_config,
    )
    if install_draws and stock:
        trainer.model.generate = _generate_with(draws)
    elif install_draws:
        trainer.rollout.sample_group = lambda state, g, *a, **k: draws(g)
    return trainer


def _generate_with(draws):
    def generate(input_ids, attention_mask=None, **kwargs):
        return torch.cat([input_ids, draws(input_ids.shape[0]).to(input_ids.device)], dim=1)

    return generate


def train_stock_and_full(
    make_model=None,
    peft_config=None,
    full_overrides=None,
    draws=scripted_rows,
    patch_generation_mixin=False,
    **overrides,
):
    """:func:`scripted_trainer` both ways, trained. With ``patch_generation_mixin`` the draws replace transformers'
    ``GenerationMixin.generate`` for both instead (the seam TRL's own tests use). Returns (start weights, stock's final
    weights, our trainer)."""
    trainers = [
        scripted_trainer(
            stock,
            peft_config,
            make_model=make_model,
            full_overrides=full_overrides,
            draws=draws,
            install_draws=not patch_generation_mixin,
            **overrides,
        )
        for stock in (True, False)
    ]
    stock, ours = trainers
    start = [{n: p.detach().clone() for n, p in t.model.named_parameters()} for t in trainers]
    for n, p in start[0].items():  # both sides start from the same weights, LoRA factors included
        assert torch.equal(p, start[1][n]), n
    seam = (
        mock.patch(
            "transformers.generation.utils.GenerationMixin.generate", side_effect=_generate_with(draws)
        )
        if patch_generation_mixin
        else contextlib.nullcontext()
    )
    with seam:
        for trainer in trainers:
            trainer.train()
    return start[0], {n: p.detach().clone() for n, p in stock.model.named_parameters()}, ours


def assert_updates_match(start: dict, stock_weights: dict, ours, tol: float = 1e-4) -> None:
    """Our trainer's weight updates equal stock's (``train_stock_and_full``), to ``tol`` of stock's largest update."""
    stock_update = {n: w - start[n].detach() for n, w in stock_weights.items()}
    ours_update = {n: p.detach() - start[n].detach() for n, p in ours.model.named_parameters()}
    scale = max(u.abs().max() for u in stock_update.values())
    assert scale > 1e-3  # the steps moved the weights
    for name, ref in stock_update.items():
        torch.testing.assert_close(ours_update[name], ref, atol=tol * scale, rtol=0, msg=name)
