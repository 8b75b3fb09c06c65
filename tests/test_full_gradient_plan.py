"""The planner's full-gradient memory (``longstraw plan --gradient-mode full [--offload cpu]``) against the tensors a
capture and a replay really hold (tiny Qwen3.5 hybrid, fp32 on CPU): the dK/dV buffers beside the K/V pages, the GDN
states kept at every capture-chunk boundary, and, with ``offload_prompt_state="cpu"``, which of them the host holds."""

from __future__ import annotations

import pytest
import torch
from _models import build_hybrid
from _reference import VOCAB

from longstraw_trl import capture_prompt, replay_logprobs
from longstraw_trl.engine import StateGrads
from longstraw_trl.host_memory import storage_device
from longstraw_trl.planner import format_plan, full_gradient_bytes, plan_memory
from longstraw_trl.presets import preset_config

PROMPT, CHUNK, PAGE = 29, 8, 6


def _measured(model, offload):
    """``(dK/dV buffer bytes, kept boundary bytes, kept tensors, state, grads)`` of one capture and one replay's
    backward."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
    state = capture_prompt(
        model, prompt, chunk_size=CHUNK, page_size=PAGE, keep_boundaries=True, offload_prompt_state=offload
    )
    grads = StateGrads(state)
    completion = torch.randint(0, VOCAB, (1, 5), generator=gen)
    replay_logprobs(state, model, completion, grad=True, grads=grads)[0].sum().backward()
    kv_layers = [i for i, layer in state.layers.items() if layer.kind == "kv"]
    buffers = sum(grads.kv(i).nbytes() for i in kv_layers)
    kept = [t for layers in state.boundaries.values() for s in layers.values() for t in s.grad_tensors()]
    return buffers, sum(t.numel() * t.element_size() for t in kept), kept, state, grads


def test_full_gradient_plan_counts_the_buffers_and_kept_states_where_they_live():
    model = build_hybrid("qwen3_5")
    config = model.config
    for offload in (None, "cpu"):
        buffers, kept_bytes, kept, state, _ = _measured(model, offload)
        host = storage_device(state.device, offload)
        assert all(t.device == host for t in kept)  # the kept states follow the offload setting
        planned = full_gradient_bytes(config, PROMPT, 1, PAGE, 4, CHUNK, offload)
        total_buffers, total_kept, _, host_buffers, host_kept = planned
        gdn_bytes = state.nbytes_by_kind()["gdn"]  # one leaf gradient per GDN layer, on the device
        assert total_buffers == buffers + gdn_bytes
        assert total_kept == kept_bytes > 0
        assert (host_buffers, host_kept) == ((buffers, kept_bytes) if offload else (0, 0))

    # the plan: what the host holds leaves the device peaks and counts against the host's memory
    kwargs = dict(
        prompt_tokens=1 << 20,
        lora_rank=64,
        gradient_mode="full",
        capture_chunk_size=16384,
        page_size=16384,
        dtype_bytes=2,
    )
    qwen = preset_config("qwen3.6-27b", 8)
    resident, off = (plan_memory(qwen, **kwargs, offload_prompt_state=o) for o in (None, "cpu"))
    assert off.host_kept_boundaries == off.kept_boundaries == resident.kept_boundaries > 0
    assert 0 < off.host_gradient_buffers < off.gradient_buffers  # the pages' dK/dV; the GDN leaves stay
    moved = off.host_gradient_buffers + off.host_kept_boundaries
    assert off.host_bytes == off.host_state + moved
    # pinned: the state and the kept states; the dK/dV buffers are pageable host memory (KVGrad's torch.zeros)
    assert off.host_pinned_bytes == off.host_state + off.host_kept_boundaries < off.host_bytes
    text = format_plan(off)
    assert "pinned: the dK/dV buffers are pageable" in text, text
    assert resident.replay_peak - off.replay_peak == off.host_state - off.offload_workspace + moved
    assert (
        resident.prompt_backward_peak - off.prompt_backward_peak
        == off.host_state - off.offload_workspace + moved
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_kept_states_wait_in_host_memory_on_cuda():
    """On a GPU with ``offload_prompt_state="cpu"`` the kept GDN boundary states are pinned host tensors, and the
    prompt backward (which brings each back to the device) gives the gradient of a resident capture."""
    from _reference import param_grads

    from longstraw_trl.engine import prompt_backward

    model = build_hybrid("qwen3_5").cuda()
    got = {}
    for offload in (None, "cpu"):
        model.zero_grad()
        _, _, kept, state, grads = _measured(model, offload)
        if offload:
            assert all(t.device.type == "cpu" and t.is_pinned() for t in kept)
        else:
            assert all(t.is_cuda for t in kept)
        prompt_backward(state, model, grads)
        got[offload] = param_grads(model)
    for name, g in got[None].items():
        torch.testing.assert_close(got["cpu"][name], g, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_page_gradients_are_added_without_waiting_for_the_device():
    """The full gradient's dK/dV of offloaded pages go into host buffers queued behind the running kernels: the sink
    returns while the GPU is still busy (``dk.to("cpu")`` then a CPU add waited for it, every earlier page of every
    segment), and :meth:`KVGrad.take` gives exactly the host fp32 sum of what was handed in, in order. The first
    round is not timed: it allocates the pinned staging buffers, and a pinned allocation waits for the device."""
    from longstraw_trl.host_memory import HOST_ADDS
    from longstraw_trl.layer_state import KVPages
    from longstraw_trl.state_grads import KVGrad

    dev = torch.device("cuda")
    pages = KVPages(4, 64, 64, 256, torch.bfloat16, torch.device("cpu"), offloaded=True)
    pages.reserve(512)
    pages.append(torch.randn(4, 512, 64, dtype=torch.bfloat16), torch.randn(4, 512, 64, dtype=torch.bfloat16))
    grads = KVGrad(pages)
    expected = [torch.zeros(4, 512, 64), torch.zeros(4, 512, 64)]
    for trial in range(4):
        dk, dv = torch.randn(4, 512, 64, device=dev), torch.randn(4, 512, 64, device=dev)
        torch.cuda.synchronize()
        busy = torch.cuda.Event()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the gradients
        dk, dv = (
            dk * 1.0,
            dv[:, :, :].transpose(0, 1).contiguous().transpose(0, 1),
        )  # made after it; dv strided
        busy.record()
        grads.sink_joined(pages)(dk, dv)
        if trial:
            assert not busy.query(), (
                f"round {trial}: the gradient's add waited for the device (a synchronous copy)"
            )
        expected[0] += dk.cpu()
        expected[1] += dv.cpu()
        HOST_ADDS.wait()  # the staging buffers are back for the next round
    got_k, got_v = grads.take(0, 512, dev)
    assert torch.equal(got_k.cpu(), expected[0]) and torch.equal(got_v.cpu(), expected[1])
