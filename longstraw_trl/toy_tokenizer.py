"""A tiny character-level tokenizer built locally, for tests, the demo and benchmarks.

Nothing can be downloaded on the machines this project runs on, so every test builds its model from a config
(random init) and its tokenizer here. The tokenizer is a Hugging Face `tokenizers` `WordLevel` model whose
"words" are single characters, wrapped in `PreTrainedTokenizerFast`, so TRL and transformers treat it like any
other fast tokenizer (padding, `batch_decode`, chat templates).

Vocabulary (ids are stable for a given `vocab_size`):

- `0` `<pad>`, `1` `<bos>`, `2` `<eos>`, `3` `<unk>`  (the special tokens);
- then single characters in this order: space, newline, `a`-`z`, `0`-`9`, common punctuation, `A`-`Z`,
  cut off at `vocab_size`;
- if `vocab_size` is larger than that, filler tokens `<extra_0>`, `<extra_1>`, ... (never produced by
  encoding, but a randomly initialised model can sample them; they decode to their own text).

Characters outside the vocabulary encode to `<unk>`. Encoding adds no special tokens (no `<bos>`/`<eos>`
post-processor): callers prepend `<bos>` themselves if they want it. Decoding concatenates the characters
(no spaces are inserted between tokens). A minimal chat template (`"{role}: {content}\\n"` per message, then
`"assistant: "` when `add_generation_prompt=True`) is attached, so conversational datasets work too; it uses
only lowercase letters, `:`, space and newline, which every `vocab_size >= 45` covers.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "TOY_CHAT_TEMPLATE", "build_toy_tokenizer"]

SPECIAL_TOKENS: dict[str, str] = {
    "pad_token": "<pad>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
}

# Characters in id order after the special tokens: the most useful ones first, so that small vocabularies
# still cover lowercase text, digits and the chat template.
_CHARS = (
    " \n"
    + string.ascii_lowercase
    + string.digits
    + ".,:;!?'\"-()[]{}<>/\\=+*_#%&@$|~^`"
    + string.ascii_uppercase
)

TOY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_toy_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """Build a character-level fast tokenizer with exactly `vocab_size` tokens, without any download.

    Args:
        vocab_size (`int`, *optional*, defaults to `64`):
            Total number of tokens, special tokens included. Must be at least 5 (4 special tokens and one
            character). Use the same value for the model config's `vocab_size`.

    Returns:
        `PreTrainedTokenizerFast`: with `pad_token="<pad>"` (id 0), `bos_token="<bos>"` (1), `eos_token="<eos>"`
        (2), `unk_token="<unk>"` (3), left padding (as TRL expects for prompts) and the toy chat template. See the
        module docstring for the vocabulary layout.
    """
    specials = list(SPECIAL_TOKENS.values())
    if vocab_size < len(specials) + 1:
        raise ValueError(f"vocab_size must be at least {len(specials) + 1}, got {vocab_size}.")
    tokens = specials + list(_CHARS[: vocab_size - len(specials)])
    tokens += [f"<extra_{k}>" for k in range(vocab_size - len(tokens))]
    vocab = {tok: idx for idx, tok in enumerate(tokens)}

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # Every character (newline included) is its own "word".
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        padding_side="left",
        chat_template=TOY_CHAT_TEMPLATE,
        model_max_length=1 << 30,
        **SPECIAL_TOKENS,
    )
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer
