"""Engine on full-attention (GQA) families against the stock HF model (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from _models import GQA_CONFIGS, build
from _reference import (
    GRAD_VARIANTS,
    VOCAB,
    check_logprobs_against_stock,
    check_replay_grads,
)

from longstraw_trl import (
    LongStrawError,
    PromptTooLongError,
    UnsupportedModelError,
    capture_prompt,
    extend_state,
    patch_model,
    replay_logprobs,
)
from longstraw_trl.host_memory import streamed_bytes

FAMILIES = list(GQA_CONFIGS)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "prompt_len,chunk,page",
    [(1, 8, 4), (5, 16, 4), (37, 8, 5), (64, 16, 16), (50, 64, 7)],
    ids=["one-token", "shorter-than-chunk", "uneven", "aligned", "one-chunk-many-pages"],
)
def test_logprobs_match_stock_forward(family, prompt_len, chunk, page):
    check_logprobs_against_stock(build(family), prompt_len, chunk, page)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_grads_match_response_only_reference(family, variant):
    got = check_replay_grads(build(family), variant, LORA_TARGETS)
    if variant == "lora":
        assert all("lora_" in n for n in got)  # base weights are frozen


def test_nbytes_follows_the_formula():
    model = build("qwen3")
    cfg = model.config
    p = 37
    state = capture_prompt(model, torch.randint(0, VOCAB, (p,)), chunk_size=16, page_size=10)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    # the layers hold P - 1 tokens (the last one is replayed), allocated at once: no slack
    assert state.nbytes() == state.nbytes_by_kind()["kv"] == per_token * (p - 1)
    assert state.slack_bytes() == 0
    assert all(len(layer.segments) == 1 for layer in state.layers.values())
    # the seconds of each of its prefill chunks: 36 resident tokens in chunks of 16
    assert len(state.chunk_seconds) == 3 and all(x > 0 for x in state.chunk_seconds)
    assert len(extend_state(state, model, torch.randint(0, VOCAB, (5,))).chunk_seconds) == 1


def test_offload_cpu_streams_pages_and_gives_same_logprobs():
    """Offloaded K/V is streamed a page at a time (on CPU too: the same code path, the copies are no-ops),
    and the page-by-page merge gives the resident result. On CUDA the pages also live in pinned host memory
    (``tests/test_engine_gqa.py::test_offload_on_cuda_keeps_pages_on_the_host``)."""
    model = build("qwen3")
    prompt = torch.randint(0, VOCAB, (19,))
    comps = torch.randint(0, VOCAB, (2, 5))
    a = capture_prompt(model, prompt, chunk_size=8, page_size=8)
    b = capture_prompt(model, prompt, chunk_size=8, page_size=8, offload_prompt_state="cpu")
    dev = torch.device("cpu")
    resident = [blk for layer in a.layers.values() for blk in layer.stream(dev)]
    streamed = [blk for layer in b.layers.values() for blk in layer.stream(dev)]
    n = len(a.layers)
    assert [k.shape[1] for k, _ in resident] == [18] * n  # one segment a layer: one kernel call
    assert [k.shape[1] for k, _ in streamed] == [8, 8, 2] * n  # pages of 8 of the 18 resident tokens
    before = streamed_bytes()
    assert (replay_logprobs(a, model, comps) - replay_logprobs(b, model, comps)).abs().max() <= 1e-5
    assert (
        streamed_bytes() - before == b.nbytes()
    )  # one pass over every offloaded page, counted; none resident
    with pytest.raises(ValueError, match="offload"):
        capture_prompt(model, prompt, offload_prompt_state="disk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_keeps_pages_on_the_host():
    model = build("qwen3").cuda()
    prompt = torch.randint(0, VOCAB, (40,)).cuda()
    comps = torch.randint(0, VOCAB, (2, 5)).cuda()
    a = capture_prompt(model, prompt, chunk_size=16, page_size=8)
    b = capture_prompt(model, prompt, chunk_size=16, page_size=8, offload_prompt_state="cpu")
    for layer in b.layers.values():
        for k, v, _ in layer.segments:
            assert k.device.type == "cpu" and k.is_pinned() and v.is_pinned()
    assert (replay_logprobs(a, model, comps) - replay_logprobs(b, model, comps)).abs().max() <= 1e-4
    # under autograd the backward streams the pages again (prefetched on the side stream)
    grads = []
    for state in (a, b):
        model.zero_grad()
        replay_logprobs(state, model, comps, grad=True).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert ((grads[0] - grads[1]).norm() / grads[0].norm()).item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_to_device_overlaps_and_keeps_values():
    """Blocks arrive intact while the compute stream reads the previous one (a slow matmul each time);
    the next block's copy is issued before the current block is handed out."""
    from longstraw_trl.host_memory import prefetch_to_device

    dev = torch.device("cuda")
    # token ranges of a pinned [heads, capacity, dim] segment, as offloaded K/V pages are (not contiguous)
    segment = torch.randn(2, 6 * 256, 1024).pin_memory()
    blocks = [(segment[:, i * 256 : (i + 1) * 256], None) for i in range(6)]
    weight = torch.randn(1024, 1024, device=dev)
    seen = []
    for moved, none in prefetch_to_device(iter(blocks), dev):
        assert none is None and moved.device.type == "cuda"
        for _ in range(20):  # keep the compute stream busy while the next copy runs
            moved = moved @ weight / 32
        seen.append(moved.sum())
    expected = []
    for block, _ in blocks:
        x = block.to(dev)
        for _ in range(20):
            x = x @ weight / 32
        expected.append(x.sum())
    assert torch.allclose(torch.stack(seen), torch.stack(expected), rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_pages_stream_after_their_own_writes():
    """Pages written to pinned host memory on the compute stream (asynchronously, behind slow kernels) and streamed
    back at once on the side stream come back as written: the side stream waits for the writes."""
    from longstraw_trl.layer_state import KVPages

    dev = torch.device("cuda")
    weight = torch.randn(2048, 2048, device=dev) / 45
    for trial in range(3):
        pages = KVPages(2, 64, 64, 512, torch.float32, torch.device("cpu"), offloaded=True)
        pages.reserve(1024)
        x = torch.randn(2048, 2048, device=dev)
        for _ in range(100):  # the writes below wait for these on the compute stream
            x = torch.tanh(x @ weight)
        k = x[:1024, :128].reshape(2, 512, 128)[..., :64].contiguous() + trial
        pages.append(k[:, :512], k[:, :512])
        pages.append(k[:, 512:], k[:, 512:])
        got = torch.cat([kk for kk, _ in pages.stream(dev)], 1)
        assert torch.equal(got, k), f"trial {trial}: streamed pages differ from what was written"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_capture_writes_do_not_wait_for_the_device():
    """A chunk's K/V written into an offloaded segment (a token range of ``[heads, capacity, dim]``: not contiguous,
    from a transposed projection: not contiguous either) is queued behind the running kernels, not waited for: torch's
    own copy_ took such a pair through pageable host memory, synchronously (82 s of a 154 s capture at 512K on an
    H100). The values arrive intact."""
    from longstraw_trl.host_memory import copy_across_devices
    from longstraw_trl.layer_state import KVPages

    dev = torch.device("cuda")
    pages = KVPages(4, 64, 64, 256, torch.bfloat16, torch.device("cpu"), offloaded=True)
    pages.reserve(1024)
    k = torch.randn(1, 512, 4, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2)[
        0
    ]  # [4, 512, 64], strided
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the writes
    busy.record()
    pages.append(k, v)
    assert not busy.query(), "the write waited for the device (a synchronous copy)"
    torch.cuda.synchronize()
    # and back: a token range of the segment copied to the device, queued behind running kernels too
    torch.cuda._sleep(2_000_000_000)
    busy.record()
    back = torch.empty(4, 256, 64, device=dev, dtype=torch.bfloat16)
    copy_across_devices(back, pages.segments[0][0][:, 128:384])
    assert not busy.query(), "the read waited for the device (a synchronous copy)"
    torch.cuda.synchronize()
    assert torch.equal(back, k[:, 128:384])
    blocks = list(pages.stream(dev))
    assert torch.equal(torch.cat([b[0] for b in blocks], 1), k)
    assert torch.equal(torch.cat([b[1] for b in blocks], 1), v)


def test_offloaded_streams_wait_for_the_writes_of_their_segments(monkeypatch):
    """The event of the last device-to-host write travels with the segments (forks, prefix views) and every stream of
    them hands it to the side stream (CPU: the event is a stand-in; the GPU test above checks the ordering itself)."""
    import longstraw_trl.layer_state as st

    seen = []
    monkeypatch.setattr(
        st, "prefetch_to_device", lambda pieces, device, after=None: seen.append(after) or iter(())
    )
    pages = st.KVPages(2, 4, 4, 8, torch.float32, torch.device("cpu"), offloaded=True)
    pages.append(torch.randn(2, 20, 4), torch.randn(2, 20, 4))
    pages._host_written = written = object()
    for view in (pages, pages.fork(), pages.prefix(12)):
        list(view.stream(torch.device("cpu")))
    assert seen == [written] * 3


def test_bad_inputs_raise_clear_errors():
    model = build("qwen3")
    with pytest.raises(LongStrawError, match="empty"):
        capture_prompt(model, torch.tensor([], dtype=torch.long))
    with pytest.raises(LongStrawError, match="outside the vocabulary"):
        capture_prompt(model, torch.tensor([1, 2, VOCAB]))
    with pytest.raises(LongStrawError, match="outside the vocabulary"):
        capture_prompt(model, torch.tensor([-1, 2]))
    with pytest.raises(PromptTooLongError, match="max_position_embeddings is 512"):
        capture_prompt(model, torch.zeros(513, dtype=torch.long))
    with pytest.raises(LongStrawError, match="1-D"):
        capture_prompt(model, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(LongStrawError, match="integer"):
        capture_prompt(model, torch.zeros(3))
    state = capture_prompt(model, torch.zeros(500, dtype=torch.long), chunk_size=128, page_size=128)
    with pytest.raises(PromptTooLongError):
        replay_logprobs(state, model, torch.zeros(1, 20, dtype=torch.long))
    with pytest.raises(LongStrawError, match="right-padded"):
        replay_logprobs(state, model, torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]))


def test_unsupported_model_names_supported_types():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported model types: .*qwen3"):
        patch_model(model)
    # sliding windows are supported now (tests/test_engine_window.py: qwen2/qwen3/qwen3_moe with
    # use_sliding_window=True); what the engine cannot reproduce is still refused by name
    dropout = build("qwen2")
    dropout.config.attention_dropout = 0.1
    with pytest.raises(UnsupportedModelError, match="attention_dropout"):
        patch_model(dropout)


@pytest.mark.parametrize("variant", ["checkpoint_layers", "hf_gradient_checkpointing"])
def test_checkpointed_replay_attends_to_the_pages_once(monkeypatch, variant):
    """A checkpointed layer's recompute reuses the page attention of its first forward: one page pass a layer in
    forward + recompute (not two), the same gradients as the response-only reference, nothing left over."""
    import longstraw_trl.context as engine

    calls = []
    real = engine.pages_attention
    monkeypatch.setattr(engine, "pages_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build("qwen3")
    layers = model.config.num_hidden_layers
    check_replay_grads(model, variant, ["q_proj"])
    assert len(calls) == layers, (len(calls), layers)
