"""Shared-prefix generation against stock ``model.generate`` (same seed => same draws)."""

from __future__ import annotations

import pytest
import torch
from _models import build

from longstraw_trl import LongStrawError, capture_prompt, generate_from_state

SAMPLING = {
    "greedy": dict(do_sample=False),
    "temperature-topk-topp": dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.9),
    "minp": dict(do_sample=True, temperature=1.3, min_p=0.05, top_k=50),
}


@pytest.mark.parametrize("family", ["qwen3", "llama", "glm4_moe"])
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_generate_matches_stock_generate(family, mode):
    """Draws are shared: both consume the global RNG with one multinomial over [G, vocab] per step."""
    model = build(family)
    prompt = torch.randint(0, 97, (33,), generator=torch.Generator().manual_seed(0))
    state = capture_prompt(model, prompt, chunk_size=8, page_size=5)
    kw = SAMPLING[mode]
    torch.manual_seed(5)
    ids = generate_from_state(state, model, 3, 12, eos_token_id=7, pad_token_id=96, **kw)
    inp = prompt[None].expand(3, -1)
    torch.manual_seed(5)
    ref = model.generate(
        inp, attention_mask=torch.ones_like(inp), max_new_tokens=12, eos_token_id=7, pad_token_id=96, **kw
    )[:, 33:]
    assert torch.equal(ids, ref)


def test_eos_pads_and_stops_early():
    """Rows that finish on different steps: the early one is padded after its EOS, the other keeps sampling, and
    the output ends on the step the last row finished (before max_new_tokens)."""
    model = build("qwen3")
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(1))
    state = capture_prompt(model, prompt)
    steps = 24
    a, b = generate_from_state(state, model, 2, steps, generator=torch.Generator().manual_seed(0)).tolist()
    # EOS ids: row 0's token at step i and row 1's at step j (i + 2 <= j < steps / 2), each drawn by neither row
    # before, so row 0 gets >= 2 pads and decoding could run on well past step j
    i, j = next(
        (i, j)
        for i in range(1, steps)
        for j in range(i + 2, steps // 2)
        if a[i] not in a[:i] + b[: j + 1] and b[j] not in b[:j] + a[: i + 1]
    )
    pad = min(set(range(97)) - set(a) - set(b))
    decode_steps = []  # decoder passes: shows whether decoding stopped (the output width alone is trimmed)
    hook = model.model.layers[0].register_forward_hook(lambda *_: decode_steps.append(1))
    try:
        ids = generate_from_state(
            state,
            model,
            2,
            steps,
            eos_token_id=[a[i], b[j]],
            pad_token_id=pad,
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        hook.remove()
    assert ids.shape == (2, j + 1)  # ends on the step row 1 finished
    assert len(decode_steps) < steps - 1  # and stopped before max_new_tokens
    assert ids[0].tolist() == a[: i + 1] + [pad] * (j - i)  # row 0: its EOS, then only padding
    # row 1 is not disturbed by row 0 finishing: it draws what it drew without EOS ids
    assert ids[1].tolist() == b[: j + 1]


def test_generate_rejects_bad_arguments():
    model = build("qwen3")
    state = capture_prompt(model, torch.tensor([1, 2, 3]))
    with pytest.raises(LongStrawError, match="temperature"):
        generate_from_state(state, model, 2, 4, temperature=0.0)
    with pytest.raises(LongStrawError, match=">= 1"):
        generate_from_state(state, model, 0, 4)


def test_decode_past_announced_capacity_grows_the_buffer():
    from longstraw_trl.engine import ForwardContext, forward_model

    model = build("qwen3")
    state = capture_prompt(model, torch.randint(0, 97, (11,)))
    toks = torch.randint(0, 97, (2, 5))
    start = state.resident_tokens
    with torch.no_grad():
        full = forward_model(model, toks, start, ForwardContext("replay", state))
        ctx = ForwardContext("decode", state, capacity=2)  # too small on purpose
        steps = [forward_model(model, toks[:, i : i + 1], start + i, ctx)[:, -1] for i in range(5)]
    assert ctx.running[0].k.shape[2] >= 5  # it grew
    assert (torch.stack(steps, 1) - full).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma2", "gpt_oss"])
def test_cuda_graph_decode_equals_eager(family):
    """Decode steps replayed as one CUDA graph give the eager steps' tokens and log-probs (bf16, greedy), and
    the graph is really used: after the first step the model's forward is not called again."""
    from _models import WINDOW_CONFIGS, build_hybrid, build_window

    from longstraw_trl.generation import DecodeStep

    if family in WINDOW_CONFIGS:  # window layers (a response past the window), soft-caps, sinks
        model = build_window(family)
    else:
        model = build(family) if family == "qwen3" else build_hybrid(family)
    model = model.cuda().to(torch.bfloat16)
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture_prompt(model, prompt, chunk_size=128, page_size=64)
    eager = generate_from_state(state, model, 4, 24, do_sample=False, cuda_graphs=False)
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    graphed = generate_from_state(state, model, 4, 24, do_sample=False, cuda_graphs=True)
    hook.remove()
    assert torch.equal(eager, graphed)
    assert len(calls) == 2  # the eager first step and the capture; the other 22 steps are graph replays
    step = DecodeStep(model, state, 4, 8, cuda_graphs=True)
    first = state.last_token.view(1, 1).expand(4, 1)
    step(first)
    assert step.graph is not None


# ----------------------------------------------------------------------------------------------------------------------
# Logits processors before the warpers (repetition penalty, bad words, minimum lengths, suppressed tokens)
# ----------------------------------------------------------------------------------------------------------------------
def _options(prompt):
    p = prompt.tolist()
    return dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        sequence_bias={(p[-1], 5): -2.5, (11,): 1.5, (40, 41): 3.0},
        # one bad word per kind: a token, a pair ending the prompt, three tokens reaching into the left padding
        bad_words_ids=[[17], [p[-1], 9], [0, p[0], p[1], 21], [30, 31]],
        min_length=prompt.numel() + 5,
        min_new_tokens=3,
        suppress_tokens=[4, 8],
        begin_suppress_tokens=[12, 13],
    )


@pytest.mark.parametrize("length_option", ["min_length", "min_new_tokens"])
@pytest.mark.parametrize("prompt_len,padding", [(30, 0), (30, 4), (2, 0), (2, 3)])
def test_logits_processing_equals_transformers_processors(prompt_len, padding, length_option):
    """Same scores in, same scores out as the processors `model.generate` builds (`_get_logits_processor`) on the
    left-padded `pad + prompt + generated` ids, step after step, with sequences that trigger every option."""
    from transformers import GenerationConfig

    from longstraw_trl.generation import LogitsProcessing

    model = build("qwen3")
    gen = torch.Generator().manual_seed(prompt_len + padding)
    prompt = torch.randint(1, 97, (prompt_len,), generator=gen)
    g, steps, eos, pad = 5, 8, [7, 3], 0
    opts = _options(prompt)
    opts.pop("min_new_tokens" if length_option == "min_length" else "min_length")
    config = GenerationConfig(**opts, eos_token_id=eos, pad_token_id=pad)
    config._eos_token_tensor = torch.tensor(eos)
    if length_option == "min_new_tokens":  # as generate's _prepare_generated_length sets it
        config.min_length = opts["min_new_tokens"] + padding + prompt_len
    inputs = torch.cat([torch.full((padding,), pad), prompt])[None].expand(g, -1)
    attention = torch.cat([torch.zeros(padding), torch.ones(prompt_len)]).long()[None].expand(g, -1)
    hf = model._get_logits_processor(
        config, inputs.shape[1], device="cpu", model_kwargs={"attention_mask": attention}
    )
    ours = LogitsProcessing(97, g, torch.device("cpu"), eos, pad, prompt, inputs.shape[1], **opts)
    generated = torch.zeros(g, steps, dtype=torch.long)
    p = [int(prompt[i % prompt_len]) for i in range(5)]
    forced = [  # rows that start the sequences, then follow the processed scores' argmax
        [40, 30, 5, 17],  # sequence bias, a bad word
        [p[-1], 2, 2, 2],  # a bad word pair ending the prompt
        [p[0], 9, 30, 40],  # a bad word reaching into the left padding
        [p[3], p[4], p[3], p[4]],  # 3-grams of the prompt, then of the generated tokens
        [pad, pad, pad],  # 3-grams of the left padding
    ]
    for step in range(steps):
        scores = torch.randn(g, 97, generator=gen) * 3
        ref = hf(torch.cat([inputs, generated[:, :step]], 1), scores.clone())
        got = ours(step, generated, scores.clone())
        assert torch.equal(got, ref), step
        nxt = torch.tensor(
            [row[step] if step < len(row) else int(got[i].argmax()) for i, row in enumerate(forced)]
        )
        generated[:, step] = nxt
        ours.append(nxt)


@pytest.mark.parametrize("mode", ["greedy", "minp"])
def test_generate_with_processors_matches_stock_generate(mode):
    model = build("qwen3")
    prompt = torch.randint(0, 97, (33,), generator=torch.Generator().manual_seed(0))
    state = capture_prompt(model, prompt, chunk_size=8, page_size=5)
    # an EOS id past the vocabulary (as tokenizers larger than the head have) is ignored by the masks, as in HF
    kw = dict(SAMPLING[mode], **_options(prompt), eos_token_id=[7, 500], pad_token_id=96)
    torch.manual_seed(5)
    ids = generate_from_state(state, model, 3, 12, prompt_ids=prompt, **kw)
    inp = prompt[None].expand(3, -1)
    torch.manual_seed(5)
    ref = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=12, **kw)[:, 33:]
    assert torch.equal(ids, ref)
    # the repetition penalty reads the prompt: without prompt_ids it is refused, not applied to half the input
    with pytest.raises(LongStrawError, match="prompt_ids"):
        generate_from_state(state, model, 3, 4, repetition_penalty=1.3)
    with pytest.raises(LongStrawError, match="33 tokens"):
        generate_from_state(state, model, 3, 4, repetition_penalty=1.3, prompt_ids=prompt[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_processors_with_cuda_graph_decode_equal_eager():
    """The processors run on the device, outside the decode step's CUDA graph: same tokens as eager decoding."""
    model = build("qwen3").cuda().to(torch.bfloat16)
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture_prompt(model, prompt, chunk_size=128, page_size=64)
    kw = dict(do_sample=False, eos_token_id=7, prompt_ids=prompt, **_options(prompt.cpu()))
    eager = generate_from_state(state, model, 4, 24, cuda_graphs=False, **kw)
    graphed = generate_from_state(state, model, 4, 24, cuda_graphs=True, **kw)
    assert torch.equal(eager, graphed)
