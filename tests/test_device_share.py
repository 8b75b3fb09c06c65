"""Partial residency of an offloaded prompt state (``capture_prompt(device_share=...)``): whole layers stay on the
device while they fit the share, in layer order; only the others stream from host memory. Log-probs, generations and
gradients equal the all-streamed and the resident state's; the bytes streamed shrink by the layers kept."""

from __future__ import annotations

import pytest
import torch
from _models import build, build_hybrid
from _reference import VOCAB

from longstraw_trl import DeviceShare, capture_prompt, extend_state, generate_from_state, replay_logprobs
from longstraw_trl.host_memory import streamed_bytes

HYBRID_4 = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])  # GQA, and a GDN hybrid (its GDN states stay anyway)
def test_layers_within_the_share_stay_and_the_rest_stream(family):
    torch.manual_seed(0)
    model = (
        build(family)
        if family == "qwen3"
        else build_hybrid(family, num_hidden_layers=4, layer_types=HYBRID_4)
    )
    prompt = torch.randint(0, VOCAB, (41,))
    comps = torch.randint(0, VOCAB, (2, 5))
    resident = capture_prompt(model, prompt, chunk_size=16, page_size=8)
    streamed = capture_prompt(model, prompt, chunk_size=16, page_size=8, offload_prompt_state="cpu")
    kv = [i for i, layer in streamed.layers.items() if getattr(layer, "offloaded", False)]
    assert len(kv) >= 2
    per_layer = streamed.layers[kv[0]].nbytes()
    share = DeviceShare(
        per_layer * (len(kv) - 1) + per_layer // 2
    )  # all but one K/V layer fit, with room to spare
    partial = capture_prompt(
        model, prompt, chunk_size=16, page_size=8, offload_prompt_state="cpu", device_share=share
    )
    offloaded = [i for i in kv if partial.layers[i].offloaded]
    assert offloaded == kv[-1:]  # layer order: the last K/V layer is the one left over
    assert share.taken == per_layer * (len(kv) - 1) and partial.device_share is None
    for i in kv[:-1]:
        (segment,) = partial.layers[i].segments
        assert not partial.layers[i].decode_streams(torch.device("cpu")) and segment[0].shape[1] == 40

    before = streamed_bytes()
    want = replay_logprobs(resident, model, comps)
    assert streamed_bytes() == before
    got_streamed = replay_logprobs(streamed, model, comps)
    all_bytes = streamed_bytes() - before
    got_partial = replay_logprobs(partial, model, comps)
    part_bytes = streamed_bytes() - before - all_bytes
    assert (got_partial - want).abs().max() <= 1e-5 and (got_streamed - want).abs().max() <= 1e-5
    assert all_bytes == per_layer * len(kv) and part_bytes == per_layer  # only the layer left over streams

    # an extension's new tokens follow each layer's place; generation reads both kinds alike
    more = torch.randint(0, VOCAB, (7,))
    ext_partial, ext_resident = extend_state(partial, model, more), extend_state(resident, model, more)
    assert [i for i in kv if ext_partial.layers[i].offloaded] == kv[-1:]
    assert (
        replay_logprobs(ext_partial, model, comps) - replay_logprobs(ext_resident, model, comps)
    ).abs().max() <= 1e-5
    kwargs = dict(num_generations=2, max_new_tokens=6, do_sample=False)
    assert torch.equal(
        generate_from_state(partial, model, **kwargs), generate_from_state(resident, model, **kwargs)
    )


def test_a_share_smaller_than_a_layer_keeps_none_and_one_share_spans_states():
    model = build("qwen3")
    prompt = torch.randint(0, VOCAB, (33,))
    whole = capture_prompt(model, prompt, chunk_size=16, page_size=8, offload_prompt_state="cpu")
    per_layer = next(iter(whole.layers.values())).nbytes()
    tiny = DeviceShare(per_layer - 1)
    none_kept = capture_prompt(model, prompt, page_size=8, offload_prompt_state="cpu", device_share=tiny)
    assert all(layer.offloaded for layer in none_kept.layers.values()) and tiny.taken == 0
    share = DeviceShare(per_layer * (len(whole.layers) + 1))  # one state's layers and one more
    first = capture_prompt(model, prompt, page_size=8, offload_prompt_state="cpu", device_share=share)
    second = capture_prompt(model, prompt, page_size=8, offload_prompt_state="cpu", device_share=share)
    assert not any(layer.offloaded for layer in first.layers.values())
    assert [layer.offloaded for layer in second.layers.values()] == [False] + [True] * (len(whole.layers) - 1)
    resident = capture_prompt(model, prompt, page_size=8, device_share=DeviceShare(0))  # no offload: ignored
    assert not any(layer.offloaded for layer in resident.layers.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_kept_layers_live_on_the_device_and_the_rest_pinned():
    model = build("qwen3").cuda()
    prompt = torch.randint(0, VOCAB, (40,)).cuda()
    comps = torch.randint(0, VOCAB, (2, 5)).cuda()
    a = capture_prompt(model, prompt, chunk_size=16, page_size=8)
    per_layer = next(iter(a.layers.values())).nbytes()
    b = capture_prompt(
        model,
        prompt,
        chunk_size=16,
        page_size=8,
        offload_prompt_state="cpu",
        device_share=DeviceShare(per_layer),
    )
    places = [
        (layer.segments[0][0].device.type, layer.segments[0][0].is_pinned()) for layer in b.layers.values()
    ]
    assert places[0] == ("cuda", False) and all(p == ("cpu", True) for p in places[1:])
    assert (replay_logprobs(a, model, comps) - replay_logprobs(b, model, comps)).abs().max() <= 1e-4
