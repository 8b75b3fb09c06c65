"""The fused Gated DeltaNet decode step (kernels/gated_delta_rule/decode.py) against the torch path it replaces.

The reference is the torch decode path of ``gdn_forward``: ``causal_conv1d_with_state``, HF's gating and
``gated_delta_step`` (themselves tested against HF and the naive recurrence in test_kernels_gdn.py).

CPU tests run the Triton kernels in Triton's interpreter (fp32: the interpreter rounds fp32 -> bf16 by
truncation, so bf16 is checked on the GPU only). They skip without triton (CI) and on CUDA machines, where
tests/conftest.py leaves ``TRITON_INTERPRET`` alone (triton reads it on import, so it is set there, before any
test module imports triton) and the GPU tests below run the compiled kernels instead.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from longstraw_trl import capture_prompt, generate_from_state
from longstraw_trl.kernels.causal_conv1d import causal_conv1d_with_state
from longstraw_trl.kernels.gated_delta_rule import gated_delta_step
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV

gdn_decode = importlib.import_module("longstraw_trl.kernels.gated_delta_rule.decode")
qwen3_5_patch = importlib.import_module("longstraw_trl.model_patches.qwen3_5")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def interpreted():
    """Skip unless the kernels run in Triton's interpreter (tests/conftest.py turns it on without CUDA)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(gdn_decode.tl.zeros, InterpretedFunction):
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 was not set before triton was imported)")


# ------------------------------------------------------------------------------------------------------
# inputs and the torch reference
# ------------------------------------------------------------------------------------------------------
def _layer(Hk, Hv, Dk, Dv, ks, bias=True, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    C = 2 * Hk * Dk + Hv * Dv
    p = dict(
        conv_weight=torch.randn(C, 1, ks, generator=gen) * 0.5,
        conv_bias=torch.randn(C, generator=gen) * 0.1 if bias else None,
        A_log=torch.empty(Hv).uniform_(0.1, 2.0, generator=gen).log(),
        dt_bias=torch.randn(Hv, generator=gen),
    )
    p = {k: None if v is None else v.to(device=device, dtype=dtype) for k, v in p.items()}
    return p, dict(num_k_heads=Hk, head_k_dim=Dk, head_v_dim=Dv)


def _token(B, C, Hv, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 1, C, generator=gen)
    a = torch.randn(B, 1, Hv, generator=gen) * 2
    b = torch.randn(B, 1, Hv, generator=gen) * 2
    return tuple(t.to(device=device, dtype=dtype) for t in (x, a, b))


def _torch_step(x, a, b, p, heads, conv_state, recurrent):
    """The torch decode path of ``gdn_forward`` for one token (fresh output states)."""
    Hk, Dk, Dv = heads["num_k_heads"], heads["head_k_dim"], heads["head_v_dim"]
    B, Hv = x.shape[0], a.shape[-1]
    y, conv = causal_conv1d_with_state(
        x.transpose(1, 2), p["conv_weight"], p["conv_bias"], conv_state, "silu"
    )
    q, k, v = torch.split(y.transpose(1, 2), [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    beta = b.sigmoid()
    g = -p["A_log"].float().exp() * F.softplus(a.float() + p["dt_bias"])
    o, rec = gated_delta_step(
        q.reshape(B, 1, Hk, Dk), k.reshape(B, 1, Hk, Dk), v.reshape(B, 1, Hv, Dv), g, beta, recurrent, True
    )
    return o, conv, rec


def _fused_step(x, a, b, p, heads, conv_state, recurrent, in_place=False):
    return gdn_decode.gdn_decode_step(
        x, a, b, **p, conv_state=conv_state, recurrent_state=recurrent, **heads, in_place=in_place
    )


def _states(B, C, ks, Hv, Dk, Dv, dtype=torch.float32, device="cpu", seed=1, batch=None):
    gen = torch.Generator().manual_seed(seed)
    n = B if batch is None else batch
    conv = torch.randn(n, C, ks - 1, generator=gen).to(device=device, dtype=dtype)
    rec = (0.5 * torch.randn(n, Hv, Dk, Dv, generator=gen)).to(device)
    return conv, rec


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------------
# CPU: the kernels in Triton's interpreter (fp32)
# ------------------------------------------------------------------------------------------------------
# ragged head dims (tile masks), C not a multiple of the channel block, 1x / 2x / 3x grouped value heads,
# kernel sizes 2 to 4, with / without the conv bias
SHAPES = [
    dict(B=2, Hk=2, Hv=4, Dk=12, Dv=20, ks=4, bias=True),
    dict(B=2, Hk=1, Hv=3, Dk=16, Dv=40, ks=3, bias=False),
    dict(B=1, Hk=2, Hv=2, Dk=6, Dv=5, ks=2, bias=True),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_fused_step_matches_torch_step(interpreted, shape):
    B, Hk, Hv, Dk, Dv, ks = (shape[k] for k in ("B", "Hk", "Hv", "Dk", "Dv", "ks"))
    C = 2 * Hk * Dk + Hv * Dv
    p, heads = _layer(Hk, Hv, Dk, Dv, ks, bias=shape["bias"])
    x, a, b = _token(B, C, Hv)
    conv, rec = _states(B, C, ks, Hv, Dk, Dv)
    starts = {
        "given": (conv, rec),
        "none": (None, None),  # the start of a sequence: zero states
        "expanded": tuple(t[:1].expand(B, *t.shape[1:]) for t in (conv, rec)),  # a prompt state (stride 0)
        "wide": (torch.cat([torch.randn(B, C, 1), conv], dim=-1), rec),  # only the last ks - 1 columns count
    }
    for name, (c0, r0) in starts.items():
        copies = [None if t is None else t.clone() for t in (c0, r0)]
        o, c1, r1 = _fused_step(x, a, b, p, heads, c0, r0)
        o_ref, c_ref, r_ref = _torch_step(x, a, b, p, heads, c0, r0)
        assert o.shape == (B, 1, Hv, Dv) and o.dtype == x.dtype, name
        assert c1.shape == (B, C, ks - 1) and c1.dtype == x.dtype and r1.dtype == torch.float32, name
        assert _max_err(o, o_ref) <= 1e-5, f"{name}: out {_max_err(o, o_ref):.2e}"
        assert torch.equal(c1, c_ref), name  # the new conv state is a shift: exact
        assert _max_err(r1, r_ref) <= 1e-5, f"{name}: state {_max_err(r1, r_ref):.2e}"
        for t, copy in zip((c0, r0), copies, strict=True):  # not in place: the inputs are untouched
            assert t is None or torch.equal(t, copy), name


def test_in_place_chain_matches_torch_chain(interpreted):
    """Four steps updating the same state tensors in place (as a CUDA-graph decode does) against the torch
    steps rebinding fresh states; fp32 drift stays at rounding level."""
    B, Hk, Hv, Dk, Dv, ks = 2, 2, 4, 12, 20, 4
    C = 2 * Hk * Dk + Hv * Dv
    p, heads = _layer(Hk, Hv, Dk, Dv, ks)
    conv, rec = _states(B, C, ks, Hv, Dk, Dv)
    ref_conv, ref_rec = conv.clone(), rec.clone()
    ptrs = conv.data_ptr(), rec.data_ptr()
    for t in range(4):
        x, a, b = _token(B, C, Hv, seed=100 + t)
        o, c1, r1 = _fused_step(x, a, b, p, heads, conv, rec, in_place=True)
        assert c1 is conv and r1 is rec
        o_ref, ref_conv, ref_rec = _torch_step(x, a, b, p, heads, ref_conv, ref_rec)
        assert _max_err(o, o_ref) <= 1e-5, f"step {t}: out {_max_err(o, o_ref):.2e}"
    assert (conv.data_ptr(), rec.data_ptr()) == ptrs
    assert torch.equal(conv, ref_conv)
    assert _max_err(rec, ref_rec) <= 1e-5


def test_bad_inputs_are_refused():
    B, Hk, Hv, Dk, Dv, ks = 2, 2, 4, 4, 4, 4
    C = 2 * Hk * Dk + Hv * Dv
    p, heads = _layer(Hk, Hv, Dk, Dv, ks)
    x, a, b = _token(B, C, Hv)
    conv, rec = _states(B, C, ks, Hv, Dk, Dv)
    cases = {
        "one token per sequence": (torch.cat([x, x], 1), a, b, conv, rec, {}),
        "a must be": (x, a[..., :-1], b, conv, rec, {}),
        "channels": (x[..., :-1], a, b, conv, rec, {}),
        "b must be": (x, a, b[:1], conv, rec, {}),
        "conv_state must be": (x, a, b, conv[..., :1], rec, {}),
        "recurrent_state must be fp32": (x, a, b, conv, rec.double(), {}),
        "in_place needs conv_state given": (x, a, b, None, rec, dict(in_place=True)),
        "contiguous": (x, a, b, conv, rec[:1].expand_as(rec), dict(in_place=True)),
        "unsupported activation": (x, a, b, conv, rec, dict(activation="gelu")),
    }
    for match, (xx, aa, bb, c0, r0, kw) in cases.items():
        with pytest.raises(ValueError, match=match):
            gdn_decode.gdn_decode_step(xx, aa, bb, **p, conv_state=c0, recurrent_state=r0, **heads, **kw)
    with pytest.raises(ValueError, match="multiple of the q/k heads"):
        gdn_decode.gdn_decode_step(
            x, a, b, **p, conv_state=conv, recurrent_state=rec, **{**heads, "num_k_heads": 3}
        )


def test_ok_needs_cuda_and_no_grad():
    t = torch.zeros(2, requires_grad=True)
    assert not gdn_decode.gdn_decode_available(t.detach())  # CPU
    assert not gdn_decode.gdn_decode_available()
    if torch.cuda.is_available():
        assert not gdn_decode.gdn_decode_available(t.cuda())  # needs a gradient


@contextlib.contextmanager
def _fused_on_cpu(monkeypatch, calls):
    """Let the model patch take the fused step for CPU tensors (interpreted kernels), counting its calls."""
    real = gdn_decode.gdn_decode_step

    def counted(*args, **kwargs):
        calls.append(kwargs["in_place"])
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(qwen3_5_patch, "gdn_decode_available", lambda *ts: not torch.is_grad_enabled())
        m.setattr(qwen3_5_patch, "gdn_decode_step", counted)
        yield


def test_model_decode_fused_matches_torch(interpreted, monkeypatch):
    """A tiny Qwen3.5 hybrid decodes through the fused step (the first step from the prompt state into new
    tensors, later steps in place) with the torch path's logits; a decode context without fixed steps rebinds
    its states as the torch path does. (qwen3_next shares ``gdn_forward``: covered on the GPU.)"""
    from _models import build_hybrid

    from longstraw_trl.engine import ForwardContext, forward_model
    from longstraw_trl.generation import DecodeStep

    model = build_hybrid("qwen3_5")
    prompt = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(0))
    state = capture_prompt(model, prompt, chunk_size=8)
    toks = torch.randint(0, 97, (2, 2), generator=torch.Generator().manual_seed(1))

    def decode(fixed: bool) -> list[torch.Tensor]:
        if fixed:
            step = DecodeStep(model, state, 2, 4, cuda_graphs=False)
            return [step(toks[:, i : i + 1]) for i in range(toks.shape[1])]
        ctx = ForwardContext("decode", state, capacity=4)
        start = state.resident_tokens
        return [forward_model(model, toks[:, i : i + 1], start + i, ctx)[:, -1] for i in range(2)]

    calls = []
    with torch.no_grad():
        ref = decode(fixed=True)
        with _fused_on_cpu(monkeypatch, calls):
            fused = decode(fixed=True)
            free = decode(fixed=False)
    n_gdn = 2  # GDN layers of the tiny hybrid
    assert calls == [False] * n_gdn + [True] * n_gdn + [False] * 2 * n_gdn
    for i, got in enumerate(fused + free):
        want = ref[i % len(ref)]
        assert _max_err(got, want) <= 1e-5, f"call {i}: {_max_err(got, want):.2e}"


# ------------------------------------------------------------------------------------------------------
# GPU: Qwen3.6-27B decode shapes in bf16, under a CUDA graph, and a whole tiny model
# ------------------------------------------------------------------------------------------------------
Q36 = dict(B=8, Hk=16, Hv=48, Dk=128, Dv=128, ks=4)  # C = 2 * 16 * 128 + 48 * 128 = 10240


def _q36(dtype=torch.bfloat16):
    B, Hk, Hv, Dk, Dv, ks = Q36.values()
    C = 2 * Hk * Dk + Hv * Dv
    p, heads = _layer(Hk, Hv, Dk, Dv, ks, dtype=dtype, device="cuda")
    conv, rec = _states(B, C, ks, Hv, Dk, Dv, dtype=dtype, device="cuda")
    return B, C, Hv, p, heads, conv, rec


@pytest.mark.gpu
@needs_cuda
def test_gpu_q36_shapes_many_steps_bf16():
    """64 chained steps, fused in place vs torch rebinding, bf16 inputs / weights and fp32 states.

    Both compute in fp32 from the same bf16 values, so they differ by fp32 summation order, plus an occasional
    1-ulp bf16 flip of a conv output (cuDNN's depthwise conv vs our fp32 sum) that then enters the state. The
    tokens' inputs do not depend on the outputs (no feedback), and the decay forgets, so the state difference
    stays at that level instead of compounding: state rel L2 <= 2e-3 and output rel L2 <= 1e-2 (bf16 eps is
    3.9e-3) at every step; the conv state is a shift of bf16 copies, so exact.
    """
    B, C, Hv, p, heads, conv, rec = _q36()
    ref_conv, ref_rec = conv.clone(), rec.clone()
    ptrs = conv.data_ptr(), rec.data_ptr()
    with torch.no_grad():
        for t in range(64):
            x, a, b = _token(B, C, Hv, dtype=torch.bfloat16, device="cuda", seed=100 + t)
            o, _, _ = _fused_step(x, a, b, p, heads, conv, rec, in_place=True)
            o_ref, ref_conv, ref_rec = _torch_step(x, a, b, p, heads, ref_conv, ref_rec)
            assert o.dtype == torch.bfloat16
            assert _rel_l2(o, o_ref) <= 1e-2, f"step {t}: out rel L2 {_rel_l2(o, o_ref):.2e}"
            assert _rel_l2(rec, ref_rec) <= 2e-3, f"step {t}: state rel L2 {_rel_l2(rec, ref_rec):.2e}"
            assert torch.equal(conv, ref_conv), f"step {t}: conv state"
    assert (conv.data_ptr(), rec.data_ptr()) == ptrs
    # and from a prompt state (a stride-0 view, read only) into new tensors, as the first decode step does
    c0, r0 = (t[:1].expand(B, *t.shape[1:]) for t in (conv, rec))
    before = c0.clone(), r0.clone()
    o, c1, r1 = _fused_step(x, a, b, p, heads, c0, r0)
    o_ref, c_ref, r_ref = _torch_step(x, a, b, p, heads, c0, r0)
    assert _rel_l2(o, o_ref) <= 1e-2 and _rel_l2(r1, r_ref) <= 1e-4 and torch.equal(c1, c_ref)
    assert torch.equal(c0, before[0]) and torch.equal(r0, before[1])


@pytest.mark.gpu
@needs_cuda
def test_gpu_in_place_step_under_cuda_graph():
    """One fused in-place step captured in a CUDA graph, replayed on new inputs: the states advance in place
    (same storage) exactly as the eager fused steps do, and track the torch steps."""
    B, C, Hv, p, heads, conv, rec = _q36()
    eager_conv, eager_rec = conv.clone(), rec.clone()
    ref_conv, ref_rec = conv.clone(), rec.clone()
    static = [torch.empty_like(t) for t in _token(B, C, Hv, dtype=torch.bfloat16, device="cuda")]
    with torch.no_grad():
        warm = [t.clone() for t in (conv, rec)]  # compile the kernels outside the capture
        _fused_step(*static, p, heads, *warm, in_place=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _, _ = _fused_step(*static, p, heads, conv, rec, in_place=True)
        ptrs = conv.data_ptr(), rec.data_ptr()
        for t in range(8):
            tok = _token(B, C, Hv, dtype=torch.bfloat16, device="cuda", seed=200 + t)
            for s, v in zip(static, tok, strict=True):
                s.copy_(v)
            graph.replay()
            o_eager, _, _ = _fused_step(*tok, p, heads, eager_conv, eager_rec, in_place=True)
            o_ref, ref_conv, ref_rec = _torch_step(*tok, p, heads, ref_conv, ref_rec)
            torch.cuda.synchronize()
            assert torch.equal(out, o_eager), f"replay {t}: output"
            assert torch.equal(conv, eager_conv) and torch.equal(rec, eager_rec), f"replay {t}: states"
            assert _rel_l2(out, o_ref) <= 1e-2 and _rel_l2(rec, ref_rec) <= 2e-3, f"replay {t}: vs torch"
    assert (conv.data_ptr(), rec.data_ptr()) == ptrs


@pytest.mark.gpu
@needs_cuda
def test_gpu_ok_and_env_switch(monkeypatch):
    t = torch.zeros(2, device="cuda")
    assert gdn_decode.gdn_decode_available(t)
    monkeypatch.setenv(DISABLE_ENV, gdn_decode.SWITCH)
    assert not gdn_decode.gdn_decode_available(t)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_generate_fused_equals_torch_path(monkeypatch, family, cuda_graphs):
    """Greedy ``generate_from_state`` on CUDA (fp32 tiny hybrid: the two paths differ only at rounding level, far
    from any argmax tie) takes the fused step (counted) and gives the torch path's tokens."""
    from _models import build_hybrid

    model = build_hybrid(family).cuda()
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture_prompt(model, prompt, chunk_size=128, page_size=64)
    monkeypatch.setenv(DISABLE_ENV, gdn_decode.SWITCH)
    ref = generate_from_state(state, model, 4, 24, do_sample=False, cuda_graphs=cuda_graphs)
    monkeypatch.delenv(DISABLE_ENV)
    calls = []
    real = qwen3_5_patch.gdn_decode_step
    monkeypatch.setattr(qwen3_5_patch, "gdn_decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = generate_from_state(state, model, 4, 24, do_sample=False, cuda_graphs=cuda_graphs)
    assert calls, "the fused decode step was not used"
    assert torch.equal(ids, ref)
