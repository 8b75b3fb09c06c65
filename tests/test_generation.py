"""Shared-prefix generation against stock ``model.generate`` (same seed => same draws)."""

from __future__ import annotations

import pytest
import torch
from _models import build

from longstraw_trl import LongStrawError, capture_prompt

SAMPLING = {
    "greedy": dict(do_sample=False),
    "temperature-topk-topp": dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.9),
    "minp": dict(do_sample=True, temperature=1.3, min_p=0.05, top_k=50),
}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_generate_matches_stock_generate(family, mode):
    """Draws are shared: both consume the global RNG with one multinomial over [G, vocab] per step."""
    model = build(family)
    prompt = torch.randint(0, 97, (33,), generator=torch.Generator().manual_seed(0))
    state = capture_prompt(model, prompt, chunk_size=8, page_size=5)
    kw = SAMPLING[mode]
    torch.manual_seed(5)
    ids = state.generate(model, 3, 12, eos_token_id=7, pad_token_id=96, **kw)
    inp = prompt[None].expand(3, -1)
    torch.manual_seed(5)
    ref = model.generate(
        inp, attention_mask=torch.ones_like(inp), max_new_tokens=12, eos_token_id=7, pad_token_id=96, **kw
    )[:, 33:]
    assert torch.equal(ids, ref)


def test_eos_pads_and_stops_early():
    model = build("qwen3")
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(1))
    state = capture_prompt(model, prompt)
    greedy = state.generate(model, 1, 6, do_sample=False)
    eos = int(greedy[0, 2])  # make the 3rd greedy token the EOS
    ids = state.generate(model, 2, 6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert ids.shape == (2, 3) and (ids[:, 2] == eos).all()


def test_generate_rejects_bad_arguments():
    model = build("qwen3")
    state = capture_prompt(model, torch.tensor([1, 2, 3]))
    with pytest.raises(LongStrawError, match="temperature"):
        state.generate(model, 2, 4, temperature=0.0)
    with pytest.raises(LongStrawError, match=">= 1"):
        state.generate(model, 0, 4)


def test_decode_past_announced_capacity_grows_the_buffer():
    from longstraw_trl.engine import ReplayContext, run_decoder

    model = build("qwen3")
    state = capture_prompt(model, torch.randint(0, 97, (11,)))
    toks = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        full = run_decoder(model, toks, 11, ReplayContext("replay", state))
        ctx = ReplayContext("decode", state)
        ctx.extra["capacity"] = 2  # too small on purpose
        steps = [run_decoder(model, toks[:, i : i + 1], 11 + i, ctx)[:, -1] for i in range(5)]
    assert (torch.stack(steps, 1) - full).abs().max() <= 1e-5
