"""Helpers for the agent-training tests: the real Qwen3.6 tokenizer, tiny models covering its ids, and a scripted
policy that makes stock `GRPOTrainer` and `LongStrawGRPOTrainer` emit the same tokens.

The scripted policy replaces only the *draw*: stock TRL's `model.generate` and the LongStraw trainer's
`Rollout.sample_group(state, G)` both return the tokens `script(context, rollout)` gives for the sequence they continue
(the LongStraw side finds that sequence as the prompt-state cache entry holding `state`). Everything else is each
trainer's own code: tool-call parsing (Qwen3.6 response template), tool execution, tool suffixes, `tool_mask`,
rewards, old log-probs and the loss (the real tiny model scores the scripted tokens).
"""

from __future__ import annotations

import atexit
import copy
import shutil
import tempfile
import warnings
from functools import lru_cache

import torch
from _models import HYBRID_COMMON, MROPE_INTERLEAVED, _moderate_gdn_decay
from _trl_helpers import _tiny_config_kwargs
from datasets import Dataset
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from longstraw_trl.qwen_tokenizer import QWEN3_6_VOCAB_SIZE, build_qwen3_6_tokenizer

PAD, EOS = 248044, 248046  # <|endoftext|>, <|im_end|>
MESSAGES = [{"role": "user", "content": "add 1 and 2"}]


@lru_cache(maxsize=1)
def _tokenizer():
    return build_qwen3_6_tokenizer()


def qwen_tokenizer():
    """The Qwen3.6 tokenizer, loaded once per process (~3 s) and copied per trainer."""
    return copy.deepcopy(_tokenizer())


def tiny_qwen3_6_vocab_model(family: str, seed: int = 0, init_std: float = 0.02):
    """A tiny random model whose vocabulary is exactly the Qwen3.6 tokenizer's (tied embeddings).

    `init_std` 0.2 instead of HF's 0.02 makes the next token depend on the context (with 0.02 the layers barely
    move the residual stream, and the model is close to a bigram model)."""
    torch.manual_seed(seed)
    ids = dict(
        vocab_size=QWEN3_6_VOCAB_SIZE,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
        initializer_range=init_std,
    )
    if family == "qwen3":
        config = Qwen3Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            **ids,
        )
    elif family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        common = {**HYBRID_COMMON, "hidden_size": 32, "intermediate_size": 64, "tie_word_embeddings": True}
        common.update(ids, max_position_embeddings=2048)
        config = Qwen3_5TextConfig(**common, rope_parameters=MROPE_INTERLEAVED)
    else:
        raise ValueError(family)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    if family == "qwen3_5":
        _moderate_gdn_decay(model)
    return model


# ----------------------------------------------------------------------------------------------------------------------
# Tools
# ----------------------------------------------------------------------------------------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The numerator.
        b: The denominator.
    """
    return a / b  # b = 0 raises: TRL answers {"error": "division by zero"}


async def lookup(key: str) -> str:
    """Look a key up in the notebook.

    Args:
        key: The key.
    """
    return {"x": "41"}.get(key, "missing")


def call(name: str, **arguments) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# turn k of rollout r (k = assistant turns already in the context). Every turn opens with its marker, so the
# script finds which rollout a context belongs to; Qwen3.6's generation prompt opens `<think>\n`.
def turn(r: int, k: int, text: str) -> str:
    return f"r{r}t{k}\n</think>\n\n{text}<|im_end|>"


SCRIPTS = {
    # add, then answer
    0: [call("add", a=1, b=2), "the sum is 3"],
    # a tool that raises, then answer
    1: [call("divide", a=1, b=0), "cannot divide"],
    # no tool
    2: ["3"],
    # a tool call on every turn: max_tool_calling_iterations=2 leaves the third one unexecuted
    3: [call("add", a=1, b=1), call("add", a=2, b=1), call("add", a=3, b=1)],
}
ASYNC_SCRIPTS = {
    0: [call("lookup", key="x"), "x is 41"],
    1: [call("lookup", key="y"), "y is missing"],
    2: ["no lookup"],
    3: [call("lookup", key="x") + "\n" + call("add", a=41, b=1), "42"],
}


class Script:
    """`script(context_ids, row) -> completion ids`: rollout `row % G` on the first turn (no marker in the context),
    else the rollout whose first marker the context holds; turn = markers in the context."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]], num_generations: int = 4):
        self.tokenizer, self.scripts, self.num_generations = tokenizer, scripts, num_generations
        self.calls: list[tuple[int, int]] = []  # (rollout, turn) of every scripted draw

    def __call__(self, context: list[int], row: int) -> list[int]:
        text = self.tokenizer.decode(context)
        markers = [r for r in self.scripts if f"r{r}t0\n" in text]
        r = markers[0] if markers else row % self.num_generations
        k = sum(text.count(f"r{r}t{j}\n") for j in range(len(self.scripts[r]) + 1))
        self.calls.append((r, k))
        return self.tokenizer(turn(r, k, self.scripts[r][k]), add_special_tokens=False)["input_ids"]


def _pad_rows(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def script_stock(trainer: GRPOTrainer, script: Script) -> None:
    """Stock TRL: `model.generate` (left-padded rows) returns `prompt + script(prompt)` per row."""

    def generate(input_ids, attention_mask, **kwargs):
        rows = [
            script(ids[m.bool()].tolist(), i)
            for i, (ids, m) in enumerate(zip(input_ids, attention_mask, strict=True))
        ]
        return torch.cat([input_ids, _pad_rows(rows).to(input_ids.device)], dim=1)

    trainer.model.generate = generate


def script_longstraw(trainer, script: Script, real_after_first_turn: bool = False) -> None:
    """LongStraw: `Rollout.sample_group(state, G)` returns `script(the sequence whose state it is)` for each of the G rows;
    with `real_after_first_turn` only the first turn is scripted and tool turns sample from their state for real."""
    real = trainer.rollout.sample_group

    def sample(state, num_generations, *args, **kwargs):
        context = next(e.prompt_ids for e in trainer.prompt_cache.entries.values() if e.state is state)
        if real_after_first_turn and trainer.prompt_states.tool_turn_keys is not None:
            return real(state, num_generations, *args, **kwargs)
        return _pad_rows([script(context.tolist(), i) for i in range(num_generations)])

    trainer.rollout.sample_group = sample


# ----------------------------------------------------------------------------------------------------------------------
# Trainers
# ----------------------------------------------------------------------------------------------------------------------
def tool_reward(completions, **kwargs):
    """Varies across the group: tool messages count 1, content characters 0.01."""
    return [
        sum(m["role"] == "tool" for m in c) + 0.01 * sum(len(str(m.get("content") or "")) for m in c)
        for c in completions
    ]


def _config(prefix: str, **kwargs):
    config = _tiny_config_kwargs(prefix, kwargs.pop("loss_type", "dapo"), kwargs.pop("beta", 0.0))
    config.update({"max_completion_length": 256, "bf16": False, **kwargs})
    atexit.register(shutil.rmtree, config["output_dir"], ignore_errors=True)
    return config


def make_pair(family: str, *, tools=None, dataset=None, reward_funcs=tool_reward, ours_kwargs=None, **kwargs):
    """(stock GRPOTrainer, LongStrawGRPOTrainer) on copies of one tiny model, with the same tools and config
    (`ours_kwargs`: LongStrawGRPOConfig's own options, e.g. gradient_mode)."""
    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    model = tiny_qwen3_6_vocab_model(family, init_std=kwargs.pop("init_std", 0.02))
    dataset = dataset or Dataset.from_dict({"prompt": [MESSAGES] * 4})
    extra = {k: kwargs.pop(k) for k in ("environment_factory", "rollout_func") if k in kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = GRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=reward_funcs,
            args=GRPOConfig(**_config("agents_stock_", **kwargs)),
            train_dataset=dataset,
            processing_class=qwen_tokenizer(),
            tools=tools,
            **extra,
        )
        ours = LongStrawGRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=LongStrawGRPOConfig(
                **_config("agents_ours_", disable_tqdm=True, **kwargs, **(ours_kwargs or {}))
            ),
            train_dataset=dataset,
            processing_class=qwen_tokenizer(),
            tools=tools,
            **extra,
        )
    ours.remove_callback(PrinterCallback)
    for trainer in (stock, ours):
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        trainer.model.train()
    return stock, ours


def tmpdir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
