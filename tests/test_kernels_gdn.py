"""Gated DeltaNet kernels: the torch chunked rule and the stateful causal conv against HF and the naive reference."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

from longstraw_trl.kernels.causal_conv1d import causal_conv1d_with_state
from longstraw_trl.kernels.gated_delta_rule.chunk import (
    chunk_gated_delta_rule_torch,
    fla_available,
    fla_backward_available,
    gated_delta_rule,
    gated_delta_step,
)
from longstraw_trl.kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV

# the package re-exports the function gated_delta_rule, which shadows the module attribute of that name
gdr_mod = importlib.import_module("longstraw_trl.kernels.gated_delta_rule.chunk")

# HF wraps these with a hub-kernel / fla dispatcher; unwrap to the torch implementations
hf_chunk = inspect.unwrap(hf_qwen35.torch_chunk_gated_delta_rule)
hf_recurrent = inspect.unwrap(hf_qwen35.torch_recurrent_gated_delta_rule)
hf_conv_fn = inspect.unwrap(hf_qwen35.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(hf_qwen35.causal_conv1d_update)


def _inputs(B=2, T=100, Hk=2, Hv=4, K=16, V=24, l2=False, seed=0, dtype=torch.float32, device="cpu", h0=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = rnd(B, T, Hk, K)
    k = rnd(B, T, Hk, K)
    if not l2:  # the delta rule is only stable for ||k|| ~ 1: normalize like fla's tests do
        k = F.normalize(k, dim=-1)
    v = rnd(B, T, Hv, V)
    g = F.logsigmoid(rnd(B, T, Hv) + 2.0)  # log decay in (-inf, 0), mostly mild
    beta = torch.rand(B, T, Hv, generator=gen)
    state = 0.5 * rnd(B, Hv, K, V) if h0 else None
    ts = [t.to(device=device, dtype=dtype) for t in (q, k, v, g, beta)]
    if state is not None:
        state = state.to(device=device)
    return ts, state


def _close(a, b, tol=1e-5):
    """max abs error <= tol * max(1, max |b|)."""
    a, b = a.double(), b.double()
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert err <= tol * scale, f"max abs err {err:.3e} > {tol:.0e} * {scale:.3g}"


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 63, 64, 150])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_matches_hf_and_naive(T, l2, with_h0):
    (q, k, v, g, beta), h0 = _inputs(T=T, l2=l2, h0=with_h0)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o, s = chunk_gated_delta_rule_torch(q, k, v, g, beta, **kw)
    o_hf, s_hf = hf_chunk(q, k, v, g, beta, **kw)
    o_hfr, s_hfr = hf_recurrent(q, k, v, g, beta, **kw)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_64, s_64 = naive_recurrent_gated_delta_rule(*(t.double() for t in (q, k, v, g, beta)), **kw)
    assert o.dtype == q.dtype and s.dtype == torch.float32
    assert o.shape == o_hf.shape and s.shape == s_hf.shape
    for o_other, s_other in ((o_hf, s_hf), (o_hfr, s_hfr), (o_ref, s_ref), (o_64, s_64)):
        _close(o, o_other)
        _close(s, s_other)


def test_block_size_invariance_and_no_final_state():
    (q, k, v, g, beta), h0 = _inputs(T=300)
    o1, s1 = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = chunk_gated_delta_rule_torch(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, block_size=64
    )
    o3, s3 = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, block_size=100)
    _close(o1, o2, 1e-6)
    _close(s1, s2, 1e-6)
    _close(o1, o3, 1e-6)
    assert s3 is None


def test_chunk_sizes():
    (q, k, v, g, beta), h0 = _inputs(T=90)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    for cs in (16, 32, 64):
        o, s = chunk_gated_delta_rule_torch(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=cs
        )
        _close(o, o_ref)
        _close(s, s_ref)


def test_bf16_inputs_follow_hf_casts():
    (q, k, v, g, beta), h0 = _inputs(T=70, l2=True)
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))  # g stays fp32, as in Qwen3.5
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_gated_delta_rule_torch(q, k, v, g, beta, **kw)
    o_hf, s_hf = hf_chunk(q, k, v, g, beta, **kw)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    _close(o.float(), o_hf.float(), 1e-2)
    _close(s, s_hf, 1e-4)


@pytest.mark.parametrize("splits", [[100, 50], [1, 63, 1, 85], [64, 64, 22], [7] * 21 + [3]])
def test_chaining_equals_one_call(splits):
    T = sum(splits)
    (q, k, v, g, beta), h0 = _inputs(T=T, l2=True, seed=1)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_full, s_full = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, **kw)
    outs, state, s0 = [], h0, 0
    for n in splits:
        sl = slice(s0, s0 + n)
        o, state = chunk_gated_delta_rule_torch(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state, **kw
        )
        outs.append(o)
        s0 += n
    _close(torch.cat(outs, dim=1), o_full)
    _close(state, s_full)


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("Hk,Hv", [(2, 4), (3, 3)])
def test_decode_step_matches_naive(l2, h0, Hk, Hv):
    """One token at a time through `gated_delta_step` (what decoding uses) equals the naive rule."""
    (q, k, v, g, beta), state = _inputs(T=7, Hk=Hk, Hv=Hv, l2=l2, h0=h0)
    ref_o, ref_s = naive_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2
    )
    s, outs = state, []
    for t in range(7):
        sl = slice(t, t + 1)
        o, s = gated_delta_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s, l2)
        outs.append(o)
    _close(torch.cat(outs, 1), ref_o)
    _close(s, ref_s)
    # the dispatcher takes the step for one graph-free token
    o1, s1 = gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state, True, l2)
    o2, s2 = gated_delta_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state, l2)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_empty_sequence_returns_fresh_state():
    (q, k, v, g, beta), h0 = _inputs(T=0)
    o, s = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 4, 24)
    assert torch.equal(s, h0) and s.data_ptr() != h0.data_ptr()


# ------------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 130])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_gradients_match_naive_and_state_is_constant(T, l2, checkpoint):
    (q, k, v, g, beta), h0 = _inputs(T=T, l2=l2, seed=2)
    h0.requires_grad_(True)  # even a state that asks for grad must be treated as a constant
    h0_copy, h0_version = h0.detach().clone(), h0._version
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    ref_ins = [t.detach().double().requires_grad_(True) for t in (q, k, v, g, beta)]
    gen = torch.Generator().manual_seed(3)
    w_o = torch.randn(2, T, 4, 24, generator=gen)
    w_s = torch.randn(2, 4, 16, 24, generator=gen)

    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o, s = chunk_gated_delta_rule_torch(*ins, initial_state=h0, checkpoint=checkpoint, block_size=64, **kw)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    o_r, s_r = naive_recurrent_gated_delta_rule(*ref_ins, initial_state=h0.detach().double(), **kw)
    ((o_r * w_o.double()).sum() + (s_r * w_s.double()).sum()).backward()

    for name, a, b in zip("q k v g beta".split(), ins, ref_ins, strict=True):
        assert _rel_l2(a.grad, b.grad) <= 1e-5, f"d{name}: rel L2 {_rel_l2(a.grad, b.grad):.2e}"
    assert h0.grad is None
    assert h0._version == h0_version
    assert torch.equal(h0.detach(), h0_copy)


def test_checkpointed_grads_equal_plain_grads():
    (q, k, v, g, beta), h0 = _inputs(T=200, l2=True, seed=4)
    grads = []
    for ckpt in (False, True):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o, s = chunk_gated_delta_rule_torch(
            *ins,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            block_size=64,
            checkpoint=ckpt,
        )
        (o.square().sum() + s.sum()).backward()
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads, strict=True):
        assert _rel_l2(a, b) <= 1e-6


def test_hf_chunk_gradients_agree():
    (q, k, v, g, beta), h0 = _inputs(T=100, l2=True, seed=5)
    grads = []
    for fn in (chunk_gated_delta_rule_torch, hf_chunk):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        o, s = fn(*ins, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (o.sin().sum() + s.cos().sum()).backward()
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads, strict=True):
        assert _rel_l2(a, b) <= 1e-5


# ------------------------------------------------------------------------------------------------------
# dispatcher
# ------------------------------------------------------------------------------------------------------
def test_dispatcher_cpu_uses_torch_and_honours_flags(monkeypatch):
    (q, k, v, g, beta), h0 = _inputs(T=70, l2=True, seed=6)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = gated_delta_rule(q, k, v, g, beta, **kw)
    o_t, s_t = chunk_gated_delta_rule_torch(q, k, v, g, beta, **kw)
    assert torch.equal(o, o_t) and torch.equal(s, s_t)
    o2, _ = gated_delta_rule(q, k, v, g, beta, **kw, scale=0.5)
    o2_r, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw, scale=0.5)
    _close(o2, o2_r)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert fla_backward_available() is False
    with pytest.raises(ValueError):
        gated_delta_rule(q, k, v, g, beta, backend="triton")
    if not fla_available():
        with pytest.raises(RuntimeError):
            gated_delta_rule(q, k, v, g, beta, backend="fla")


def test_shape_errors():
    (q, k, v, g, beta), h0 = _inputs(T=10)
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_torch(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0.transpose(-1, -2))


# ------------------------------------------------------------------------------------------------------
# causal conv1d with state
# ------------------------------------------------------------------------------------------------------
def _conv_inputs(B=2, C=6, T=40, ksize=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, T, generator=gen)
    w = torch.randn(C, ksize, generator=gen)
    b = torch.randn(C, generator=gen)
    return x, w, b


@pytest.mark.parametrize("splits", [[40], [1, 2, 5, 32], [3, 3, 3, 0, 31], [1] * 40])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("use_bias", [True, False])
def test_conv_chaining_matches_full_conv(splits, activation, use_bias):
    x, w, b = _conv_inputs()
    b = b if use_bias else None
    ref = hf_conv_fn(x, w, b, activation=activation)  # F.conv1d with left padding over the whole sequence
    ys, state, hf_state, hf_ys, s0 = [], None, torch.zeros(2, 6, 4), [], 0
    for n in splits:
        xi = x[..., s0 : s0 + n]
        y, state = causal_conv1d_with_state(xi, w, b, state, activation=activation)
        assert state.shape == (2, 6, 3)
        ys.append(y)
        if n:  # HF's cached path (width-kernel_size state, written in place)
            hf_ys.append(hf_conv_update(xi, hf_state, w, b, activation))
        s0 += n
    _close(torch.cat(ys, dim=-1), ref, 1e-6)
    _close(torch.cat(hf_ys, dim=-1), ref, 1e-6)
    _close(state, x[..., -3:], 0)


def test_conv_state_len_matches_hf_cache_width():
    x, w, b = _conv_inputs(T=10)
    hf_state = torch.zeros(2, 6, 4)
    _, s_mine = causal_conv1d_with_state(x[..., :6], w, b, None, state_len=4)
    hf_conv_update(x[..., :6], hf_state, w, b, "silu")
    assert torch.equal(s_mine, hf_state)
    # the width-4 state feeds the next chunk like a width-3 one
    y4, _ = causal_conv1d_with_state(x[..., 6:], w, b, s_mine)
    y3, _ = causal_conv1d_with_state(x[..., 6:], w, b, s_mine[..., 1:])
    assert torch.equal(y4, y3)


def test_conv_short_chunk_and_short_state():
    x, w, b = _conv_inputs(T=2)
    # T < kernel_size - 1 at the start: the new state keeps zero padding on the left
    y, s = causal_conv1d_with_state(x, w, b, None)
    _close(y, hf_conv_fn(x, w, b, activation="silu"), 1e-6)
    assert torch.equal(s[..., 0], torch.zeros(2, 6)) and torch.equal(s[..., 1:], x)
    # a state narrower than kernel_size - 1 means zeros before it
    y2, _ = causal_conv1d_with_state(x, w, b, s[..., 1:])
    y3, _ = causal_conv1d_with_state(x, w, b, s)
    assert torch.equal(y2, y3)


def test_conv_gradients_and_constant_state():
    x, w, b = _conv_inputs(T=50, seed=1)
    prompt, resp = x[..., :30], x[..., 30:]
    state = prompt[..., -3:].clone().requires_grad_(True)  # asks for grad: must still be a constant
    state_copy, state_version = state.detach().clone(), state._version
    ins = [t.clone().requires_grad_(True) for t in (resp, w, b)]
    ref_ins = [t.clone().requires_grad_(True) for t in (resp, w, b)]
    gen = torch.Generator().manual_seed(2)
    wy = torch.randn(2, 6, 20, generator=gen)

    y, new_state = causal_conv1d_with_state(ins[0], ins[1], ins[2], state)
    (y * wy).sum().backward()
    full = torch.cat([prompt, ref_ins[0]], dim=-1)
    y_ref = F.silu(F.conv1d(full, ref_ins[1].unsqueeze(1), ref_ins[2], padding=3, groups=6)[..., :50])[
        ..., 30:
    ]
    (y_ref * wy).sum().backward()

    _close(y, y_ref, 1e-6)
    for a, r in zip(ins, ref_ins, strict=True):
        assert _rel_l2(a.grad, r.grad) <= 1e-6
    assert state.grad is None and state._version == state_version
    assert torch.equal(state.detach(), state_copy)
    assert not new_state.requires_grad
    assert torch.equal(new_state, resp[..., -3:])


@pytest.mark.parametrize("state_grad", [False, True])
def test_conv_gradient_of_a_transposed_projection_comes_back_in_its_layout(state_grad):
    """GDN passes the conv ``mixed_qkv.transpose(1, 2)``: its gradient must reach the projection row-major
    (``[B, T, C]`` contiguous, as for any linear output), not as a slice of the conv window's gradient, whose row
    stride ``T + kernel_size - 1`` sent the projection's input-gradient GEMM to an unaligned cuBLAS kernel; the values
    are the plain path's."""
    x, w, b = _conv_inputs(T=50, seed=1)
    proj = x.transpose(1, 2).contiguous().requires_grad_(True)  # [B, T, C], a linear layer's output
    ref = proj.detach().clone().requires_grad_(True)
    state = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(3)).requires_grad_(state_grad)
    seen = []
    wy = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(2))
    xt = proj.transpose(1, 2)
    xt.register_hook(lambda g: seen.append(g))
    y, _ = causal_conv1d_with_state(xt, w, b, state, state_grad=state_grad)
    (y * wy).sum().backward()
    full = torch.cat([state.detach(), ref.transpose(1, 2)], dim=-1)
    y_ref = F.silu(F.conv1d(full, w.unsqueeze(1), b, groups=6))
    (y_ref * wy).sum().backward()
    (g,) = seen
    assert g.transpose(1, 2).is_contiguous()  # the projection's layout
    assert _rel_l2(proj.grad, ref.grad) <= 1e-6


def _fla_conv_semantics(x, weight, bias, initial_state=None, output_final_state=False, activation=None):
    """fla's ``causal_conv1d`` contract, written out: ``x [B, T, D]``, state ``[B, D, W]`` of which the last
    ``W - 1`` columns precede ``x`` (newest last), final state the last ``W`` inputs, fp32 math."""
    b, t, d = x.shape
    w = weight.shape[1]
    init = torch.zeros(b, d, w, dtype=x.dtype) if initial_state is None else initial_state
    full = torch.cat([init.transpose(1, 2), x], 1).float()  # [B, W + T, D]
    y = sum(weight[:, j].float() * full[:, 1 + j : 1 + j + t] for j in range(w))
    y = y + (0 if bias is None else bias.float())
    if activation == "silu":
        y = y * torch.sigmoid(y)
    final = full[:, -w:].transpose(1, 2).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final


@pytest.mark.parametrize("T,state_width", [(40, 3), (2, 3), (1, 3), (30, 1), (25, None)])
def test_conv_fla_adapter_keeps_the_torch_paths_contract(monkeypatch, T, state_width):
    """The fla fast path's layout and state conversions (a transposed view in, fla's kernel-width state around
    ours), with fla's contract written in torch, equal the torch path (CPU; the GPU test runs fla itself)."""
    import longstraw_trl.kernels.causal_conv1d.conv as conv

    x, w, b = _conv_inputs(T=T)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, C, T] view of a [B, T, C] projection
    state = None if state_width is None else torch.randn(2, 6, state_width)
    y_ref, s_ref = causal_conv1d_with_state(x, w, b, state)
    monkeypatch.setattr(conv, "_fla_conv_fn", lambda: _fla_conv_semantics)
    monkeypatch.setattr(conv, "_use_fla", lambda *a: True)
    y, s = causal_conv1d_with_state(x, w, b, state)
    _close(y, y_ref, 1e-6)
    assert torch.equal(s, s_ref) and s.shape == (2, 6, 3)


# ------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("Hk,Hv", [(4, 4), (2, 6)])
def test_gpu_bf16_torch_vs_fla_vs_naive(Hk, Hv):
    (q, k, v, g, beta), h0 = _inputs(B=2, T=333, Hk=Hk, Hv=Hv, K=128, V=128, l2=True, seed=7, device="cuda")
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    results = {"torch": chunk_gated_delta_rule_torch(q, k, v, g, beta, **kw)}
    with torch.no_grad():
        results["auto"] = gated_delta_rule(q, k, v, g, beta, **kw)
        if fla_available():
            results["fla"] = gated_delta_rule(q, k, v, g, beta, **kw, backend="fla")
            results["fla_split"] = gated_delta_rule(
                q, k, v, g, beta, **kw, backend="fla", fla_max_tokens_per_call=128
            )
    h0_copy = h0.clone()
    for name, (o, s) in results.items():
        assert o.dtype == torch.bfloat16, name
        assert _rel_l2(o, o_ref) <= 1e-2, f"{name}: out rel L2 {_rel_l2(o, o_ref):.2e}"
        assert _rel_l2(s, s_ref) <= 1e-2, f"{name}: state rel L2 {_rel_l2(s, s_ref):.2e}"
    assert torch.equal(h0, h0_copy)

    # backward through the dispatcher (torch unless LONGSTRAW_DISABLE=torch_dqkwg is allowed) vs the naive reference
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    ref_ins = [t.detach().float().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, s = gated_delta_rule(*ins, **kw)
    (o.float().square().sum() + s.sum()).backward()
    o_r, s_r = naive_recurrent_gated_delta_rule(*ref_ins, **kw)
    (o_r.square().sum() + s_r.sum()).backward()
    for name, a, b in zip("q k v g beta".split(), ins, ref_ins, strict=True):
        assert _rel_l2(a.grad, b.grad) <= 1e-2, f"d{name}: rel L2 {_rel_l2(a.grad, b.grad):.2e}"
    assert torch.equal(h0, h0_copy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,state_width", [(16384, 3), (37, 3), (2, 3), (300, 1), (50, None)])
def test_gpu_fla_conv_equals_torch_conv(monkeypatch, T, state_width):
    """The graph-free capture path (fla's Triton conv, reading the [B, T, C] projection in place) against the
    torch path on the same bf16 inputs: outputs within bf16 rounding (fla applies the SiLU before its one
    rounding, torch after), the returned state exactly the last inputs."""
    import longstraw_trl.kernels.causal_conv1d.conv as conv

    if conv._fla_conv_fn() is None:
        pytest.skip("fla not importable")
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, c, k = 2, 1280, 4
    proj = torch.randn(b, T, c, device="cuda", generator=gen).bfloat16()  # the projection's own layout
    w = (torch.randn(c, k, device="cuda", generator=gen) / 2).bfloat16()
    bias = torch.randn(c, device="cuda", generator=gen).bfloat16()
    state = None
    if state_width is not None:
        state = torch.randn(b, c, state_width, device="cuda", generator=gen).bfloat16()
    x = proj.transpose(1, 2)
    with torch.no_grad():
        assert conv._use_fla(x, w, state, False, k - 1, k - 1)
        y_fla, s_fla = causal_conv1d_with_state(x, w, bias, state)
        monkeypatch.setenv(DISABLE_ENV, "fla_conv")
        assert not conv._use_fla(x, w, state, False, k - 1, k - 1)
        y_ref, s_ref = causal_conv1d_with_state(x, w, bias, state)
    assert y_fla.shape == y_ref.shape == (b, c, T) and y_fla.dtype == torch.bfloat16
    err = ((y_fla.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()
    assert err <= 1e-2, err
    assert torch.equal(s_fla, s_ref)
