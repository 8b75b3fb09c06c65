"""Attention with LSE merging and chunked log-probs against plain torch math with autograd."""

from __future__ import annotations

import pytest
import torch

from longstraw_trl.kernels.attention import (
    attention_lse,
    merge_partials,
    naive,
    prompt_response,
    prompt_response_attention,
    sdpa,
)
from longstraw_trl.kernels.attention import window as windowed
from longstraw_trl.kernels.logprob import naive_token_logprobs, token_logprobs


def full_softmax_reference(q, kp, vp, k, v, scale):
    """Softmax over [prompt keys, response keys] with a causal mask on the response part."""
    rep = q.shape[1] // k.shape[1]
    b = q.shape[0]
    keys = torch.cat([kp.expand(b, -1, -1, -1), k], dim=2).repeat_interleave(rep, dim=1)
    vals = torch.cat([vp.expand(b, -1, -1, -1), v], dim=2).repeat_interleave(rep, dim=1)
    s = q @ keys.transpose(-1, -2) * scale
    t, p = q.shape[2], kp.shape[2]
    mask = torch.ones(t, p + t, dtype=torch.bool, device=q.device)
    mask[:, p:] = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ vals


@pytest.mark.parametrize("prompt_len,page", [(0, 4), (1, 4), (13, 4), (40, 40), (33, 7)])
def test_prompt_response_attention_forward_and_grads(prompt_len, page):
    gen = torch.Generator().manual_seed(prompt_len)
    b, hq, hkv, t, d = 3, 6, 2, 9, 8
    q = torch.randn(b, hq, t, d, generator=gen, requires_grad=True)
    k = torch.randn(b, hkv, t, d, generator=gen, requires_grad=True)
    v = torch.randn(b, hkv, t, d, generator=gen, requires_grad=True)
    kp = torch.randn(1, hkv, prompt_len, d, generator=gen)
    vp = torch.randn(1, hkv, prompt_len, d, generator=gen)
    scale = d**-0.5

    def pages():
        return [(kp[0, :, s : s + page], vp[0, :, s : s + page]) for s in range(0, prompt_len, page)]

    out = prompt_response_attention(q, k, v, pages, scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = full_softmax_reference(q, kp, vp, k, v, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert (out - ref).abs().max() <= 1e-5
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() <= 1e-5


def test_merge_is_exact_and_order_free():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=gen)
    k = torch.randn(2, 3, 30, 8, generator=gen)
    v = torch.randn(2, 3, 30, 8, generator=gen)
    whole = attention_lse(q, k, v, 0.3)
    a = attention_lse(q, k[..., :11, :], v[..., :11, :], 0.3)
    c = attention_lse(q, k[..., 11:, :], v[..., 11:, :], 0.3)
    for merged in (merge_partials(*a, *c), merge_partials(*c, *a)):
        assert (merged[0] - whole[0]).abs().max() <= 1e-6
        assert (merged[1] - whole[1]).abs().max() <= 1e-6
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
    assert (whole[0] - ref).abs().max() <= 1e-6


def test_chunked_logprobs_match_full_logits(monkeypatch):
    import longstraw_trl.kernels.logprob.chunked as lp

    monkeypatch.setattr(lp, "LOGITS_CHUNK_ELEMENTS", 50 * 7)  # force several chunks
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=gen)
    got = token_logprobs(h, head, targets, temperature=0.7)
    ref = naive_token_logprobs(h, head, targets, temperature=0.7)
    assert (got - ref).abs().max() <= 1e-6
    w = torch.randn(3, 11, generator=gen)
    g = torch.autograd.grad((got * w).sum(), (h, head.weight))
    r = torch.autograd.grad((ref * w).sum(), (h, head.weight))
    for a, b in zip(g, r, strict=True):
        assert (a - b).abs().max() <= 1e-5  # fp32 summation order differs across chunks


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_entropies_match_plain_torch(monkeypatch, entropy_grad):
    """Entropies from the chunked (checkpointed) head against `torch.distributions.Categorical(...).entropy()` on
    the full logits: values, and with `entropy_grad` the gradient of a loss mixing log-probs and entropies."""
    import longstraw_trl.kernels.logprob.chunked as lp

    monkeypatch.setattr(lp, "LOGITS_CHUNK_ELEMENTS", 50 * 7)  # force several chunks
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=True)
    h = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=gen)
    logps, entropies = token_logprobs(h, head, targets, 0.7, with_entropy=True, entropy_grad=entropy_grad)
    logits = head(h).float() / 0.7
    ref_entropies = torch.distributions.Categorical(logits=logits).entropy()
    ref_logps = torch.distributions.Categorical(logits=logits).log_prob(targets)
    assert (entropies - ref_entropies).abs().max() <= 1e-5
    assert (logps - ref_logps).abs().max() <= 1e-6
    assert entropies.requires_grad == entropy_grad
    if not entropy_grad:
        return
    w1, w2 = torch.randn(3, 11, generator=gen), torch.randn(3, 11, generator=gen)
    params = (h, head.weight, head.bias)
    g = torch.autograd.grad((logps * w1).sum() + (entropies * w2).sum(), params, retain_graph=True)
    r = torch.autograd.grad((ref_logps * w1).sum() + (ref_entropies * w2).sum(), params, retain_graph=True)
    for a, b in zip(g, r, strict=True):
        assert (a - b).norm() / b.norm() <= 1e-5
    # the entropy part on its own (so a wrong entropy gradient cannot hide behind the log-prob one)
    g = torch.autograd.grad((entropies * w2).sum(), params)
    r = torch.autograd.grad((ref_entropies * w2).sum(), params)
    for a, b in zip(g, r, strict=True):
        assert b.norm() > 0 and (a - b).norm() / b.norm() <= 1e-5


def _math_path_called(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} was called: the flash path fell back to the plain math")

    return fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("forward", ["flash", "cudnn"])
def test_flash_path_matches_math_on_cuda(dtype, forward):
    """The CUDA fast paths against the fp32 math: forward and backward by flash (few query rows) or cuDNN (many).
    Each must actually run: the math path is disabled, and cuDNN's use is counted."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, t, d, p = 2, 8, 2, 128, 128, 1000
    q = torch.randn(b, hq, t, d, generator=gen, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, t, d, generator=gen, device="cuda", dtype=dtype, requires_grad=True)
    kp = torch.randn(1, hkv, p, d, generator=gen, device="cuda", dtype=dtype)
    vp = torch.randn(1, hkv, p, d, generator=gen, device="cuda", dtype=dtype)

    def pages():
        return [(kp[0, :, s : s + 256], vp[0, :, s : s + 256]) for s in range(0, p, 256)]

    # The math path is the oracle and gives the same numbers, so a silent fallback would pass the comparison:
    # these inputs must be flash-eligible, the flash backward must pass its self-check (run now, before the
    # math path is disabled: it is its oracle), and then the math path must not run at all.
    assert sdpa._flash_available(q, k) and sdpa._flash_available(q, kp), (
        "these inputs should be flash-eligible"
    )
    assert sdpa.flash_backward_available(q), "the flash backward failed its self-check on this PyTorch"
    if forward == "cudnn":
        assert sdpa.cudnn_attention_available(q), "cuDNN attention failed its self-check on this PyTorch"
        assert sdpa.cudnn_backward_available(q), "cuDNN's backward failed its self-check on this PyTorch"
    cudnn_calls, cudnn_grad_calls = [], []
    cudnn, cudnn_grads = sdpa._cudnn_lse, sdpa._cudnn_grads
    with pytest.MonkeyPatch.context() as m:
        for name in ("naive_attention_lse", "naive_attention_grads"):
            m.setattr(sdpa, name, _math_path_called(name))
        m.setattr(sdpa, "CUDNN_MIN_QUERY_ROWS", 1 if forward == "cudnn" else 1 << 30)
        m.setattr(sdpa, "_cudnn_lse", lambda *a: cudnn_calls.append(1) or cudnn(*a))
        m.setattr(sdpa, "_cudnn_grads", lambda *a: cudnn_grad_calls.append(1) or cudnn_grads(*a))
        out = prompt_response_attention(q, k, v, pages, d**-0.5)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert bool(cudnn_calls) == bool(cudnn_grad_calls) == (forward == "cudnn")
    args = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = full_softmax_reference(args[0], kp.float(), vp.float(), args[1], args[2], d**-0.5)
    ref_grads = torch.autograd.grad(ref, args, dout.float())
    errors = [
        ((a.float() - b).norm() / b.norm()).item()
        for a, b in zip((out, *grads), (ref, *ref_grads), strict=False)
    ]
    print(f"{dtype} relative errors out/dq/dk/dv: {errors}")
    assert max(errors) <= 1e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backward", ["flash", "cudnn"])
def test_page_grads_on_cuda_match_math(backward, monkeypatch):
    """The full gradient's page dK/dV (a sink per page) and dQ at Qwen3.6's attention shape (24 q / 4 kv heads,
    d = 256, bf16) by flash's or cuDNN's backward, against autograd through the fp32 softmax over all keys."""
    if backward == "flash":
        monkeypatch.setenv("LONGSTRAW_DISABLE", "cudnn_backward")
    else:
        assert sdpa.cudnn_backward_available(torch.empty(1, 1, 1, 256, device="cuda", dtype=torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv, t, d, p = 1, 24, 4, 1024, 256, 2048
    q, k, v = (
        torch.randn(b, h, t, d, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (hq, hkv, hkv)
    )
    kp, vp = (torch.randn(1, hkv, p, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    page_starts = range(0, p, 512)
    dk_pages, dv_pages = torch.zeros(hkv, p, d, device="cuda"), torch.zeros(hkv, p, d, device="cuda")

    def pages():
        return [(kp[0, :, s : s + 512], vp[0, :, s : s + 512]) for s in page_starts]

    def sink(i):
        s = page_starts[i]

        def add(dk, dv):
            dk_pages[:, s : s + 512] += dk.float()
            dv_pages[:, s : s + 512] += dv.float()

        return add

    calls = []
    grads_fn = sdpa._cudnn_grads
    monkeypatch.setattr(sdpa, "_cudnn_grads", lambda *a: calls.append(1) or grads_fn(*a))
    out = prompt_response_attention(q, k, v, pages, d**-0.5, page_grads=sink)
    dout = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert bool(calls) == (backward == "cudnn")
    args = [x.detach().float().requires_grad_() for x in (q, k, v, kp, vp)]
    ref = full_softmax_reference(args[0], args[3], args[4], args[1], args[2], d**-0.5)
    ref_grads = torch.autograd.grad(ref, args, dout.float())
    got = (out, *grads, dk_pages[None], dv_pages[None])
    errors = [((a.float() - r).norm() / r.norm()).item() for a, r in zip(got, (ref, *ref_grads), strict=True)]
    print(f"{backward}: relative errors out/dq/dk/dv/dk_pages/dv_pages: {errors}")
    assert max(errors) <= 1e-2, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 72, 256])
@pytest.mark.parametrize("t,p", [(9, 0), (9, 13), (1, 40), (33, 200)])
def test_cpu_flash_path_matches_math(dtype, d, t, p):
    """The CPU flash ops (forward with LSE, backward from the final out/LSE) against the fp32 math with autograd:
    grouped heads, odd head dims, a non-default scale, prompt pages, decode (one query) and causal self-attention
    whose queries are the last T of their keys. The math path is disabled, so a silent fallback fails."""
    gen = torch.Generator().manual_seed(t + p + d)
    b, hq, hkv = 2, 6, 2
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype).requires_grad_() for h in (hq, hkv, hkv))
    kp, vp = (torch.randn(1, hkv, p, d, generator=gen).to(dtype) for _ in range(2))
    scale = 0.7 * d**-0.5

    def pages():
        return [(kp[0, :, s : s + 16], vp[0, :, s : s + 16]) for s in range(0, p, 16)]

    assert sdpa._cpu_flash_available(q, k, v)
    with pytest.MonkeyPatch.context() as m:
        for name in ("naive_attention_lse", "naive_attention_grads"):
            m.setattr(sdpa, name, _math_path_called(name))
        out = prompt_response_attention(q, k, v, pages, scale)
        dout = torch.randn(out.shape, generator=gen).to(dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        # the forward's LSE (natural log) and a causal call with fewer queries than keys (the additive mask)
        lse_q, lse_k = q[:, :2].detach(), k.detach()
        got_causal = sdpa.attention_lse(lse_q, lse_k, lse_k, scale, causal=True)
    args = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = full_softmax_reference(args[0], kp.float(), vp.float(), args[1], args[2], scale)
    ref_grads = torch.autograd.grad(ref, args, dout.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, r in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert ((a.float() - r).norm() / r.norm()).item() <= tol
    ref_causal = naive.naive_attention_lse(lse_q, lse_k, lse_k, scale, causal=True, q_offset=0)
    for a, r in zip(got_causal, ref_causal, strict=True):
        assert (a - r).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    if t > 1:
        few = lse_q[:, :, -3:]
        got = sdpa.attention_lse(few, lse_k, lse_k, scale, causal=True)
        want = naive.naive_attention_lse(few, lse_k, lse_k, scale, causal=True, q_offset=t - 3)
        for a, r in zip(got, want, strict=True):
            assert (a - r).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_cpu_flash_switch_and_guards(monkeypatch):
    """``LONGSTRAW_DISABLE=cpu_flash`` takes the plain math; no keys (the op would divide by zero) and value head dims other
    than the query's never reach the op."""
    q = torch.randn(1, 2, 3, 8)
    assert sdpa._cpu_flash_available(q, q, q)
    assert not sdpa._cpu_flash_available(q, q[:, :, :0], q[:, :, :0])
    assert not sdpa._cpu_flash_available(q, q, torch.randn(1, 2, 3, 4))
    monkeypatch.setenv("LONGSTRAW_DISABLE", "cpu_flash")
    assert not sdpa._cpu_flash_available(q, q, q)


# ----------------------------------------------------------------------------------------------------
# Soft-capped scores, attention sinks, sliding windows: against dense softmax with autograd (HF's eager
# formulas: soft-cap before the mask, the sink as one more softmax column that is then dropped)
# ----------------------------------------------------------------------------------------------------
def dense_reference(q, kp, vp, k, v, scale, softcap=None, sinks=None, window=None, q_pos=None):
    """Softmax over [prompt keys at positions -n..-1, own keys at 0..S-1] for queries at ``q_pos``
    (default: the last T own positions); causal, banded by ``window`` when given."""
    rep = q.shape[1] // k.shape[1]
    b, n, s_len, t = q.shape[0], kp.shape[2], k.shape[2], q.shape[2]
    keys = torch.cat([kp.expand(b, -1, -1, -1), k], dim=2).repeat_interleave(rep, dim=1)
    vals = torch.cat([vp.expand(b, -1, -1, -1), v], dim=2).repeat_interleave(rep, dim=1)
    s = q @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    k_pos = torch.arange(n + s_len, device=q.device) - n
    q_pos = torch.arange(s_len - t, s_len, device=q.device) if q_pos is None else q_pos.to(q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(b, -1, t, 1)], dim=-1)
    p = torch.softmax(s, -1)
    return p[..., : n + s_len] @ vals


def _inputs(seed, t, n, b=2, hq=4, hkv=2, d=8, gain=1.5):
    gen = torch.Generator().manual_seed(seed)
    q = (gain * torch.randn(b, hq, t, d, generator=gen)).requires_grad_()
    k = (gain * torch.randn(b, hkv, t, d, generator=gen)).requires_grad_()
    v = torch.randn(b, hkv, t, d, generator=gen, requires_grad=True)
    kp = gain * torch.randn(1, hkv, n, d, generator=gen)
    vp = torch.randn(1, hkv, n, d, generator=gen)
    sinks = torch.randn(hq, generator=gen, requires_grad=True)
    return q, k, v, kp, vp, sinks


def _assert_same(out, ref, inputs):
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for g, r in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("prompt_len", [0, 13])
def test_prompt_response_attention_softcap_and_sinks(softcap, with_sinks, prompt_len):
    """Soft-capped scores in both parts before the LSE merge, the sink as one more merge term with its own
    gradient; pages of 4 (several merges)."""
    q, k, v, kp, vp, sinks = _inputs(prompt_len, 9, prompt_len)
    sinks = sinks if with_sinks else None

    def pages():
        return [(kp[0, :, s : s + 4], vp[0, :, s : s + 4]) for s in range(0, prompt_len, 4)]

    out = prompt_response_attention(q, k, v, pages, 0.35, softcap=softcap, sinks=sinks)
    ref = dense_reference(q, kp, vp, k, v, 0.35, softcap=softcap, sinks=sinks)
    _assert_same(out, ref, (q, k, v) + ((sinks,) if with_sinks else ()))
    with torch.no_grad():  # the no-autograd path (capture, decode) gives the same
        assert (
            prompt_response_attention(q, k, v, pages, 0.35, softcap=softcap, sinks=sinks) - ref
        ).abs().max() <= 1e-5


@pytest.mark.parametrize("window,prompt_len,t", [(5, 4, 13), (5, 2, 13), (8, 7, 3), (1, 0, 6), (4, 3, 1)])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
def test_window_attention_is_the_banded_softmax(monkeypatch, window, prompt_len, t, variant):
    """Queries see keys ``x - window < y <= x`` over [prompt window | own keys]; query blocks of 3 (several
    blocks, each reading its own key range)."""
    monkeypatch.setattr(windowed, "WINDOW_QUERY_BLOCK", 3)
    q, k, v, kp, vp, sinks = _inputs(window + t, t, prompt_len)
    kw = dict(softcap=2.0 if variant == "softcap" else None, sinks=sinks if variant == "sinks" else None)
    out = windowed.window_attention(q, k, v, kp[0], vp[0], 0.35, window, **kw)
    ref = dense_reference(q, kp, vp, k, v, 0.35, window=window, **kw)
    _assert_same(out, ref, (q, k, v) + ((sinks,) if variant == "sinks" else ()))


def test_window_attention_decode_with_fixed_capacity():
    """Decode: one query at ``self_length - 1`` over a capacity buffer whose unfilled slots hold garbage."""
    window, n, cap = 4, 3, 10
    q, k, v, kp, vp, sinks = _inputs(0, cap, n)
    q, k, v = q.detach(), k.detach(), v.detach()
    for filled in (1, 4, 7, 10):
        kk, vv = k.clone(), v.clone()
        kk[:, :, filled:], vv[:, :, filled:] = 1e4, -1e4  # weighed by exactly 0
        qi = q[:, :, filled - 1 : filled]
        got = windowed.window_attention(
            qi, kk, vv, kp[0], vp[0], 0.35, window, self_length=torch.tensor(filled), sinks=sinks.detach()
        )
        ref = dense_reference(
            qi, kp, vp, k[:, :, :filled], v[:, :, :filled], 0.35, window=window, sinks=sinks.detach()
        )
        assert (got - ref).abs().max() <= 1e-5


def test_masked_decode_attention_softcap():
    q, k, v, kp, vp, _ = _inputs(1, 7, 0)
    q, k, v = q.detach()[:, :, 4:5], k.detach(), v.detach()
    out, _ = prompt_response.masked_decode_attention_lse(q, k, v, 0.35, torch.tensor(5), softcap=2.0)
    ref = dense_reference(q, kp, vp, k[:, :, :5], v[:, :, :5], 0.35, softcap=2.0)
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_softcap_takes_the_math_path_on_cuda():
    """Flash / cuDNN cannot soft-cap: with a softcap the CUDA call must not reach them (and be right)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, 64, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sdpa, "_cudnn_lse", _math_path_called("_cudnn_lse"))
        m.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", _math_path_called("flash"))
        out, _ = attention_lse(q, k, v, 0.125, causal=True, softcap=5.0)
    ref = dense_reference(
        q.float(), k[:, :, :0].float(), v[:, :, :0].float(), k.float(), v.float(), 0.125, softcap=5.0
    )
    assert (out - ref).abs().max() <= 2e-2


def test_window_attention_graph_keeps_no_scores(monkeypatch):
    """Under autograd the window path saves its inputs' views, not a ``[T, block + window]`` score tile a block."""
    monkeypatch.setattr(windowed, "WINDOW_QUERY_BLOCK", 16)
    window, t = 48, 128
    q, k, v, kp, vp, sinks = _inputs(0, t, window - 1)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = windowed.window_attention(q, k, v, kp[0], vp[0], 0.35, window, sinks=sinks)
    scores_per_block = q.shape[0] * q.shape[1] * 16 * (16 + window - 1)
    assert max(saved) < scores_per_block  # no tile was kept
    assert sum(saved) < 4 * (q.numel() + 2 * q.shape[1] // k.shape[1] * (k.numel() + kp.numel() * q.shape[0]))
    out.sum().backward()  # and backward recomputes them
    assert sinks.grad is not None and q.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rows", "keys", "d"), [(48, 70001, 256), (1542, 4133, 256), (300, 9000, 128)])
def test_prompt_dq_kernel_is_the_softmax_gradient(rows, keys, d):
    """The query-parallel dQ kernel (key splits for few rows, strided pages, ragged tiles) against autograd
    through a dense fp32 softmax over [the page | other keys], given the merged out/lse as the replay has them."""
    from longstraw_trl.kernels.attention import naive_prompt_dq
    from longstraw_trl.kernels.attention.prompt_dq import prompt_dq, prompt_dq_available

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, other, scale = 2, 37, d**-0.5
    q = torch.randn(h, rows, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    # the page is a token range of a larger [heads, capacity, dim] buffer, as a K/V segment is
    kbuf = torch.randn(h, keys + 11, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    vbuf = torch.randn(h, keys + 11, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = kbuf[:, 5 : 5 + keys], vbuf[:, 5 : 5 + keys]
    k2 = torch.randn(h, other, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v2 = torch.randn(h, other, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(h, rows, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    qf = q.float().requires_grad_()
    keys_all, vals_all = torch.cat([k, k2], 1).float(), torch.cat([v, v2], 1).float()
    s = qf @ keys_all.transpose(-1, -2) * scale
    out = torch.softmax(s, -1) @ vals_all
    lse = torch.logsumexp(s, -1).detach()
    # the page's share of dQ: autograd with the other keys' contribution removed (their scores detached)
    s_page = torch.cat([s[..., :keys], s[..., keys:].detach()], -1)
    (dq_page,) = torch.autograd.grad(torch.softmax(s_page, -1) @ vals_all, qf, dout.float())
    delta = (dout.float() * out.detach()).sum(-1)
    assert prompt_dq_available(q, k)
    got = prompt_dq(q, k, v, lse, delta, dout, scale)
    err = ((got - dq_page).norm() / dq_page.norm()).item()
    ref_err = ((naive_prompt_dq(q, k, v, lse, delta, dout, scale) - dq_page).norm() / dq_page.norm()).item()
    print(f"prompt_dq rows={rows} keys={keys} d={d}: relative error {err:.2e} (fp32 reference {ref_err:.2e})")
    assert ref_err <= 1e-4 and err <= 1e-2, (err, ref_err)


def test_prompt_dq_reference_is_the_softmax_gradient():
    """The torch reference of the dQ kernel against autograd through a dense softmax (CPU, fp32)."""
    from longstraw_trl.kernels.attention import naive_prompt_dq

    gen = torch.Generator().manual_seed(1)
    h, rows, keys, other, d = 2, 7, 19, 5, 8
    q = torch.randn(h, rows, d, generator=gen, requires_grad=True)
    k, v = torch.randn(h, keys, d, generator=gen), torch.randn(h, keys, d, generator=gen)
    k2, v2 = torch.randn(h, other, d, generator=gen), torch.randn(h, other, d, generator=gen)
    dout = torch.randn(h, rows, d, generator=gen)
    s = q @ torch.cat([k, k2], 1).transpose(-1, -2) * 0.3
    vals = torch.cat([v, v2], 1)
    out = torch.softmax(s, -1) @ vals
    s_page = torch.cat([s[..., :keys], s[..., keys:].detach()], -1)
    (dq_page,) = torch.autograd.grad(torch.softmax(s_page, -1) @ vals, q, dout)
    lse = torch.logsumexp(s, -1).detach()
    delta = (dout * out.detach()).sum(-1)
    torch.testing.assert_close(naive_prompt_dq(q.detach(), k, v, lse, delta, dout, 0.3), dq_page)


def test_prompt_dq_autotunes_on_a_key_slice_once_per_row_bucket(monkeypatch):
    """A new (device, head dim, row bucket) first launches on the first TUNE_KEYS keys only (the autotuner times
    every config on the call it sees), then on all keys; a second call of that bucket launches once."""
    import longstraw_trl.kernels.attention.prompt_dq as pdq

    calls = []
    monkeypatch.setattr(
        pdq, "_launch", lambda q, k, v, *a: calls.append((q.shape[1], k.shape[1])) or q.float()
    )
    monkeypatch.setattr(pdq, "_TUNED", set())
    monkeypatch.setattr(pdq, "TUNE_KEYS", 64)
    h, d = 2, 16

    def run(rows, keys):
        q = torch.randn(h, rows, d)
        k, v = torch.randn(h, keys, d), torch.randn(h, keys, d)
        pdq.prompt_dq(q, k, v, torch.zeros(h, rows), torch.zeros(h, rows), torch.randn(h, rows, d), 0.25)

    run(100, 1000)
    assert calls == [(100, 64), (100, 1000)]
    run(120, 5000)  # same power-of-two bucket (128): tuned already
    assert calls[2:] == [(120, 5000)]
    run(300, 50)  # a new bucket with fewer keys than the slice: tuned on the call itself
    assert calls[3:] == [(300, 50)]
