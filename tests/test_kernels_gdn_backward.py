"""The Gated DeltaNet backward through fla with our torch ``chunk_bwd_dqkwg`` (kernels/gated_delta_rule/chunk_backward.py).

CPU: the batched torch step against its plain reference (autograd of each chunk's formulas, float64), and, where
fla imports, against fla's own Triton kernel run by Triton's interpreter, and through fla's backend dispatch. fla's
other GDN kernels do not run in the interpreter (its fused forward fails there), so the whole backward is checked
on the GPU only: fla's forward/backward with our step against autograd through the torch chunked rule.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F

from longstraw_trl.kernels.gated_delta_rule.chunk import (
    fla_available,
    fla_chunk_backward_available,
    gated_delta_rule,
)
from longstraw_trl.kernels.gated_delta_rule.chunk_backward import chunk_bwd_dqkwg_torch
from longstraw_trl.kernels.gated_delta_rule.naive import naive_chunk_bwd_dqkwg
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV

gdr_mod = importlib.import_module("longstraw_trl.kernels.gated_delta_rule.chunk")
FLA_IMPORTS = importlib.util.find_spec("fla") is not None and fla_available()
needs_fla = pytest.mark.skipif(not FLA_IMPORTS, reason="flash-linear-attention (fla) not importable")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step_inputs(B=1, T=100, H=2, HV=4, K=16, V=8, C=64, seed=0, state_v_first=False):
    """Random inputs of the step with fla's conventions: g the chunk-local cumulative decay in log2 units."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    NT = -(-T // C)
    log_decay = -0.3 * torch.rand(B, T, HV, generator=gen)
    g = torch.cat([log_decay[:, s : s + C].cumsum(1) for s in range(0, T, C)], dim=1) / math.log(2)
    state_shape = (B, NT, HV, V, K) if state_v_first else (B, NT, HV, K, V)
    return dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, HV, V),
        do=rnd(B, T, HV, V),
        h=rnd(*state_shape),
        dh=rnd(*state_shape),
        w=rnd(B, T, HV, K),
        g=g,
        dv=rnd(B, T, HV, V),
        scale=0.3,
    )


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    "shape,passes",
    [
        (dict(T=100, H=2, HV=4), 64),
        (dict(T=150, H=2, HV=6), 8192),
        (dict(T=128, H=3, HV=3), 8192),
        (dict(T=37, H=1, HV=2, B=2), 8192),
    ],
)
def test_dqkwg_torch_matches_autograd_reference(shape, passes):
    """Partial last chunk, grouped value heads, several passes over the chunks, batch > 1."""
    x = _step_inputs(**shape)
    got = chunk_bwd_dqkwg_torch(**x, tokens_per_pass=passes)
    ref = naive_chunk_bwd_dqkwg(**x)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref, strict=True):
        assert a.shape == b.shape, name
        assert _rel_l2(a, b) < 1e-6, f"{name}: rel L2 {_rel_l2(a, b):.2e}"
    assert got[3].dtype == torch.float32


def test_dqkwg_state_v_first_and_dtypes():
    x = _step_inputs(T=70)
    ref = chunk_bwd_dqkwg_torch(**x)
    flipped = {**x, "h": x["h"].transpose(-1, -2).contiguous(), "dh": x["dh"].transpose(-1, -2).contiguous()}
    for a, b in zip(chunk_bwd_dqkwg_torch(**flipped, state_v_first=True), ref, strict=True):
        torch.testing.assert_close(a, b)
    half = {key: (t.bfloat16() if torch.is_tensor(t) and key != "g" else t) for key, t in x.items()}
    dq, dk, dw, dg = chunk_bwd_dqkwg_torch(**half)
    assert (dq.dtype, dk.dtype, dw.dtype, dg.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    assert _rel_l2(dg, ref[3]) < 3e-2
    # without w (no delta rule): no dw, and dq, dk, dg as with a zero dv
    dq0, dk0, dw0, dg0 = chunk_bwd_dqkwg_torch(**{**x, "w": None, "dv": None})
    zero_dv = chunk_bwd_dqkwg_torch(**{**x, "dv": torch.zeros_like(x["dv"])})
    assert dw0 is None
    for a, b in zip((dq0, dk0, dg0), (zero_dv[0], zero_dv[1], zero_dv[3]), strict=True):
        torch.testing.assert_close(a, b)


def test_dqkwg_rejects_what_it_does_not_serve():
    x = _step_inputs(T=70)
    with pytest.raises(ValueError, match="gated"):
        chunk_bwd_dqkwg_torch(**{**x, "g": None})
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_bwd_dqkwg_torch(**x, cu_seqlens=torch.tensor([0, 70]))
    with pytest.raises(ValueError, match="one state per chunk"):
        chunk_bwd_dqkwg_torch(**{**x, "h": x["h"][:, :1], "dh": x["dh"][:, :1]})


@needs_fla
def test_dqkwg_torch_matches_fla_kernel_and_serves_fla_dispatch(monkeypatch):
    """fla's own Triton kernel (interpreted on CPU) computes what ours does; once registered, fla's dispatched
    ``chunk_bwd_dqkwg`` returns ours while the ``gdn_backward`` switch is on and fla's kernel when it is off."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU only: fla's kernel in Triton's interpreter (the GPU tests run it compiled)")
    import triton.runtime.autotuner as autotuner
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg

    # the interpreter has no benchmarker: fla's autotuned kernel takes its first config
    monkeypatch.setattr(
        autotuner.Autotuner, "do_bench", property(lambda self: lambda fn, quantiles=None: [1.0] * 3)
    )
    x = _step_inputs(T=100, H=2, HV=4, K=16, V=16)
    ours = chunk_bwd_dqkwg_torch(**x)
    monkeypatch.setenv(DISABLE_ENV, gdr_mod.GDN_BACKWARD_SWITCH)
    assert not fla_chunk_backward_available()
    fla_kernel = chunk_bwd_dqkwg(**x, chunk_size=64)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), ours, fla_kernel, strict=True):
        assert _rel_l2(a, b) < 1e-5, f"{name}: rel L2 {_rel_l2(a, b):.2e}"
    monkeypatch.delenv(DISABLE_ENV)
    assert fla_chunk_backward_available()
    for a, b in zip(chunk_bwd_dqkwg(**x, chunk_size=64), ours, strict=True):
        assert torch.equal(a, b)
    accepts = gdr_mod._own_dqkwg_accepts
    assert accepts(**x)[0] and not accepts(**x, cu_seqlens=torch.tensor([0, 100]))[0]


@pytest.mark.gpu
@needs_cuda
def test_gpu_dqkwg_real_heads_matches_reference():
    """On CUDA, at Qwen3.6-27B's head counts (16 q/k, 48 value heads, d 128) with fla's bf16 intermediates and two
    passes over the chunks (the second partial), against the float64 reference on the same values."""
    x = _step_inputs(T=70, H=16, HV=48, K=128, V=128, seed=3)
    cuda = {
        key: (t.cuda().to(torch.bfloat16 if key != "g" else t.dtype) if torch.is_tensor(t) else t)
        for key, t in x.items()
    }
    got = chunk_bwd_dqkwg_torch(**cuda, tokens_per_pass=64)
    ref = naive_chunk_bwd_dqkwg(
        **{key: (t.cpu().float() if torch.is_tensor(t) else t) for key, t in cuda.items()}
    )
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref, strict=True):
        assert a.is_cuda and _rel_l2(a.cpu(), b) < (1e-5 if name == "dg" else 1e-2), (
            name
        )  # dq, dk, dw: bf16 out


# ------------------------------------------------------------------------------------------------------
# GPU: fla's whole backward with our step against autograd through the torch chunked rule
# ------------------------------------------------------------------------------------------------------
def _gdn_inputs(T, Hk, Hv, D, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k, v = rnd(1, T, Hk, D), rnd(1, T, Hk, D), rnd(1, T, Hv, D)
    g = F.logsigmoid(rnd(1, T, Hv) + 4.0)  # fp32 log decay as Qwen3.5 computes it; memory across chunks
    beta = torch.rand(1, T, Hv, device="cuda", generator=gen)
    h0 = 0.2 * rnd(1, Hv, D, D)
    do, dht = rnd(1, T, Hv, D), rnd(1, Hv, D, D)
    return [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype), h0], do, dht


def _grads(backend, inputs, do, dht):
    """Output, final state and the gradients of q, k, v, g, beta and the initial state."""
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    o, s = gated_delta_rule(
        *ins[:5],
        initial_state=ins[5],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        backend=backend,
        state_grad=True,
    )
    ((o.float() * do).sum() + (s * dht).sum()).backward()
    return [o, s] + [t.grad for t in ins]


class _CountingStep:
    """Stands in for the registered backend's step (fla's registry resolves it by attribute), counting calls and
    optionally breaking one output (the negative control)."""

    def __init__(self, break_dq=False):
        self.calls, self.break_dq = 0, break_dq

    def __call__(self, *args, **kwargs):
        self.calls += 1
        dq, dk, dw, dg = chunk_bwd_dqkwg_torch(*args, **kwargs)
        return (dq * 1.1 if self.break_dq else dq), dk, dw, dg


def _spy(monkeypatch, step):
    from fla.backends import _get_operation_registry

    assert fla_chunk_backward_available()
    backend = _get_operation_registry("common")._backends["longstraw_torch"]
    monkeypatch.setattr(backend, "chunk_bwd_dqkwg", step, raising=False)
    return step


NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.mark.gpu
@needs_cuda
@needs_fla
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 2e-2)])
def test_gpu_fla_backward_with_our_step_matches_torch_rule(monkeypatch, dtype, tol):
    """Real head counts (16 q/k, 48 value heads, d 128), 4,096 tokens, a differentiable initial state and a final
    state gradient: every gradient within ``tol`` (relative L2) of autograd through the torch chunked rule in fp32."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    step = _spy(monkeypatch, _CountingStep())
    inputs, do, dht = _gdn_inputs(4096, 16, 48, 128, dtype)
    got = _grads("fla", inputs, do, dht)
    assert step.calls == 1
    ref = _grads("torch", [t.float() for t in inputs], do, dht)
    for name, a, b in zip(NAMES, got, ref, strict=True):
        assert a is not None and a.dtype == (
            torch.float32 if name in ("final_state", "dg", "dh0") else dtype
        ), name
        assert _rel_l2(a, b) <= tol, f"{name}: rel L2 {_rel_l2(a, b):.2e} > {tol}"


@pytest.mark.gpu
@needs_cuda
@needs_fla
def test_gpu_broken_step_is_caught_and_dispatcher_takes_the_path(monkeypatch):
    """Negative control: a step with dq 10% off fails the comparison above. And the dispatcher's default for a
    bf16 call needing backward is this path; ``LONGSTRAW_DISABLE=gdn_backward`` takes the torch chunked rule."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    inputs, do, dht = _gdn_inputs(1024, 4, 12, 128, torch.bfloat16, seed=1)
    ref = _grads("torch", [t.float() for t in inputs], do, dht)
    step = _spy(monkeypatch, _CountingStep(break_dq=True))
    broken = _grads("fla", inputs, do, dht)
    assert step.calls == 1 and _rel_l2(broken[2], ref[2]) > 5e-2
    step = _spy(monkeypatch, _CountingStep())
    auto = _grads("auto", inputs, do, dht)
    assert step.calls == 1
    for name, a, b in zip(NAMES, auto, ref, strict=True):
        assert _rel_l2(a, b) <= 2e-2, f"{name}: rel L2 {_rel_l2(a, b):.2e}"
    monkeypatch.setenv(DISABLE_ENV, gdr_mod.GDN_BACKWARD_SWITCH)
    torch_rule = _grads("auto", inputs, do, dht)
    assert step.calls == 1
    ref_bf16 = _grads("torch", inputs, do, dht)
    for name, a, b in zip(NAMES, torch_rule, ref_bf16, strict=True):
        assert _rel_l2(a, b) <= 1e-6, name
