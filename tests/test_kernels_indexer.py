"""The DSA indexer's scores and top-k: the fused Triton kernel and the torch path against plain fp64 math.

The reference (:func:`reference_scores`) is the formula itself in fp64 on the same (half) inputs: both paths
compute exact half products and accumulate in fp32, so they differ from it only by fp32 rounding of the sums
(:func:`assert_scores_close`). The kernel's own tests run on CUDA (``gpu``), and on the CPU under Triton's
interpreter where Triton is installed (fp16: the interpreter's bf16 ``tl.dot`` is broken, it returns
garbage; the kernel does not depend on the half type).
"""

from __future__ import annotations

import pytest
import torch

import longstraw_trl.kernels.sparse_attention.dsa as sparse
import longstraw_trl.kernels.sparse_attention.indexer as ix
from longstraw_trl import generate_from_state, replay_logprobs
from longstraw_trl.kernels.runtime.switches import DISABLE_ENV
from longstraw_trl.kernels.sparse_attention import index_scores, naive_index_scores
from longstraw_trl.kernels.sparse_attention.dsa import indexer_topk, topk_merge
from longstraw_trl.kernels.sparse_attention.indexer import index_scores_kernel
from longstraw_trl.kernels.sparse_attention.naive import matmul_fp32

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def inputs(b, t, h, d, n, key_batch, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=gen, device=device).to(dtype)
    w = torch.randn(b, t, h, generator=gen, device=device) * h**-0.5
    k = torch.randn(key_batch, n, d, generator=gen, device=device).to(dtype)
    return q, w, k


def reference_scores(q, w, k, scale, q_pos=None, key_pos=None, key_chunk=1 << 16):
    """``sum_h w_h * scale * relu(q_h . k)`` in fp64 (and ``|.|`` of each term summed: the rounding scale),
    key chunk by key chunk."""
    outs, mags = [], []
    for c in range(0, k.shape[1], key_chunk):
        s = torch.einsum(
            "bthd,bld->bthl", q.double(), k[:, c : c + key_chunk].double().expand(q.shape[0], -1, -1)
        )
        a = torch.einsum(
            "bthd,bld->bthl",
            q.double().abs(),
            k[:, c : c + key_chunk].double().abs().expand(q.shape[0], -1, -1),
        )
        wd = w.double().unsqueeze(-1) * scale
        outs.append((wd * s.clamp_min(0)).sum(2))
        mags.append((wd.abs() * a).sum(2))
    out, mag = torch.cat(outs, -1), torch.cat(mags, -1)
    if q_pos is not None:
        out = out.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return out, mag


def assert_scores_close(got, ref, mag, rel=1e-5):
    """fp32 sums of 128 products per head and 32 heads: each output's error is at most a few units of fp32
    rounding (2^-24 = 6e-8) times the sum of the magnitudes of its terms (``mag``) times the depth of the sum
    (the GEMM's and the head sum's); 1e-5 of ``mag`` leaves a margin of ~2x over the worst case and ~100x
    over the typical one, and a wrong head, key, row or weight is off by O(mag)."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), "the mask differs"
    assert (got[~finite] == float("-inf")).all()
    err = (got.double() - ref).abs()[finite]
    bound = rel * mag[finite] + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.2f}x the bound (max abs error {err.max().item():.3g})"


# ----------------------------------------------------------------------------------------------------
# The torch path (CPU)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key_batch", [1, 2])
def test_torch_path_writes_into_a_buffer_slice_with_the_mask(key_batch):
    b, t, h, d, n = 2, 5, 4, 16, 23
    q, w, k = inputs(b, t, h, d, n, key_batch, dtype=torch.float32)
    q_pos, key_pos = torch.arange(t) + 15, torch.arange(n)
    buf = torch.full((b, t, n + 7), 3.25)
    out = index_scores(q, w, k, 0.3, out=buf[..., 4 : 4 + n], q_pos=q_pos, key_pos=key_pos)
    assert out.data_ptr() == buf[..., 4:].data_ptr()
    ref, mag = reference_scores(q, w, k, 0.3, q_pos, key_pos)
    assert_scores_close(buf[..., 4 : 4 + n], ref, mag)
    assert (buf[..., :4] == 3.25).all() and (buf[..., 4 + n :] == 3.25).all()  # nothing outside the slice
    assert torch.isinf(ref).any() and torch.isfinite(ref).any()


def test_bad_inputs_are_named():
    q, w, k = inputs(2, 3, 4, 16, 9, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="weights"):
        index_scores(q, w[:, :, :2], k, 0.3)
    with pytest.raises(ValueError, match="keys"):
        index_scores(q, w, torch.cat([k, k, k]), 0.3)
    with pytest.raises(ValueError, match="scale must be positive"):
        index_scores(q, w, k, -0.3)
    with pytest.raises(ValueError, match="both q_pos and key_pos"):
        index_scores(q, w, k, 0.3, q_pos=torch.arange(3))
    with pytest.raises(ValueError, match="out must be fp32"):
        index_scores(q, w, k, 0.3, out=torch.empty(2, 3, 8))


def _topk_sets(scores, pos):
    return [
        sorted(p[s > float("-inf")].tolist())
        for s, p in zip(scores.flatten(0, 1), pos.flatten(0, 1), strict=True)
    ]


def test_indexer_topk_merges_equal_one_topk_of_all_scores(monkeypatch):
    """Several buffers per query block and several tiles per buffer (the running top-k behind each new
    buffer, positions gathered from either part) against one top-k of all the scores; keys at non-contiguous
    positions (a context-parallel rank's pages), with and without the causal mask."""
    monkeypatch.setattr(sparse, "TOPK_BUFFER_ELEMENTS", 3 * 11)  # 11 keys per merge at 3 queries
    monkeypatch.setattr(sparse, "SCORE_TILE_ELEMENTS", 3 * 4 * 4)  # 4 keys per tile
    b, t, h, d, n, k = 1, 3, 4, 16, 50, 7
    q, w, keys = inputs(b, t, h, d, n, 1, dtype=torch.float32, seed=3)
    key_pos = (torch.arange(n) // 5) * 10 + torch.arange(n) % 5  # pages of 5 at every other page
    for q_pos in (None, torch.tensor([3, 40, 97])):
        got_s, got_p = indexer_topk(q, w, keys, key_pos, q_pos, 0.25, k)
        ref, _ = reference_scores(q, w, keys, 0.25, q_pos, None if q_pos is None else key_pos)
        top, i = ref.float().topk(k, -1)
        assert _topk_sets(got_s, got_p) == _topk_sets(top, key_pos[i])
        diff = (got_s.sort(-1).values - top.sort(-1).values).nan_to_num()  # (-inf - -inf: nan, equal)
        assert diff.abs().max() <= 1e-5
    # topk_merge: one part empty, and positions of both parts
    s, p = topk_merge(got_s, got_p, got_s[..., :0], got_p[..., :0], 4)
    assert torch.equal(s.sort(-1).values, got_s.topk(4, -1).values.sort(-1).values)
    s, p = topk_merge(got_s[..., :0], got_p[..., :0], got_s, got_p, 4)
    assert _topk_sets(s, p) == _topk_sets(*_top(got_s, got_p, 4))


def _top(s, p, k):
    v, i = s.topk(k, -1)
    return v, p.gather(-1, i)


# ----------------------------------------------------------------------------------------------------
# The kernel under Triton's CPU interpreter (where Triton is installed)
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")  # (imported before the switch: the kernel calls no @jit library function)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ix._kernel.cache_clear()  # the kernel is built (jit or interpreted) when first used
    yield
    ix._kernel.cache_clear()


@pytest.mark.parametrize(
    "b,t,h,d,n,key_batch,tile",
    [
        (1, 37, 4, 16, 300, 1, (64, 256)),
        (3, 5, 4, 16, 131, 1, (16, 128)),
        (2, 19, 4, 16, 45, 2, (32, 128)),
        (1, 130, 4, 16, 129, 1, (128, 128)),
        (1, 20, 32, 128, 70, 1, (64, 128)),
    ],
    ids=["ragged", "shared-keys-batch", "per-sequence-keys", "two-row-tiles", "glm-5-heads"],
)
def test_kernel_under_the_interpreter(interpreter, b, t, h, d, n, key_batch, tile):
    """Every tile shape the kernel uses, on ragged sizes, with the mask, into a slice of a buffer (CPU)."""
    q, w, k = inputs(b, t, h, d, n, key_batch, dtype=torch.float16, seed=t)
    q_pos, key_pos = torch.arange(t) + n - t // 2, torch.arange(n)
    buf = torch.full((b, t, n + 5), 7.0)
    index_scores_kernel(q, w, k, 0.3, out=buf[..., 2 : 2 + n], q_pos=q_pos, key_pos=key_pos, tile=tile)
    ref, mag = reference_scores(q, w, k, 0.3, q_pos, key_pos)
    assert_scores_close(buf[..., 2 : 2 + n], ref, mag)
    assert (buf[..., :2] == 7.0).all() and (buf[..., 2 + n :] == 7.0).all()
    got = index_scores_kernel(q[:, :, :], w, k, 0.3, tile=tile)  # no mask, a new tensor
    ref, mag = reference_scores(q, w, k, 0.3)
    assert_scores_close(got, ref, mag)


# ----------------------------------------------------------------------------------------------------
# The kernel on CUDA
# ----------------------------------------------------------------------------------------------------
GPU_CASES = [
    # b, t, h, d, n, key batch, mask: a capture block, ragged everything, shared keys for a batch (decoding
    # rows and a replay batch), per-sequence keys (the responses' own), another head dim
    (1, 4096, 32, 128, 5000, 1, False),
    (1, 300, 32, 128, 4133, 1, True),
    (3, 77, 32, 128, 1029, 1, True),
    (8, 1, 32, 128, 70001, 1, False),
    (2, 130, 32, 128, 2053, 2, True),
    (2, 33, 16, 64, 999, 1, True),
]


def _check_kernel_case(b, t, h, d, n, key_batch, mask, tile):
    q, w, k = inputs(b, t, h, d, n, key_batch, device="cuda", seed=n)
    # views with gaps, as indexer_topk passes them: a query block of a longer chunk, a key range of pages
    q = torch.cat([q, q[:, :3]], 1)[:, :t]
    k = torch.cat([k, k[:, :5]], 1)[:, :n]
    q_pos = torch.arange(t, device="cuda") + n - t // 2 if mask else None
    key_pos = torch.arange(n, device="cuda") if mask else None
    buf = torch.full((b, t, n + 9), 7.0, device="cuda")
    index_scores_kernel(q, w, k, d**-0.5, out=buf[..., 4 : 4 + n], q_pos=q_pos, key_pos=key_pos, tile=tile)
    ref, mag = reference_scores(q, w, k, d**-0.5, q_pos, key_pos)
    assert_scores_close(buf[..., 4 : 4 + n], ref, mag)
    assert (buf[..., :4] == 7.0).all() and (buf[..., 4 + n :] == 7.0).all()
    return q, w, k, ref, mag


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("b,t,h,d,n,key_batch,mask", GPU_CASES)
def test_kernel_matches_fp64_reference_on_cuda(b, t, h, d, n, key_batch, mask):
    """The tuned kernel (the dispatch takes it) and the torch path, against the same fp64 reference."""
    q, w, k, ref, mag = _check_kernel_case(b, t, h, d, n, key_batch, mask, None)
    assert ix.index_scores_kernel_available(q, k)
    torch_path = naive_index_scores(q, w, k, d**-0.5).masked_fill(~torch.isfinite(ref), float("-inf"))
    assert_scores_close(torch_path, ref, mag)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tile", sorted(ix._CONFIGS))
def test_every_kernel_tile_on_cuda(tile):
    """Each tile shape the tuner or the small-row configs may pick, on ragged sizes with the mask."""
    _check_kernel_case(2, 300, 32, 128, 4133, 1, True, tile)


@pytest.mark.gpu
@cuda
def test_kernel_offsets_past_two_to_the_31():
    """Score views of more than 2^31 elements (1040 queries x 2M keys) and key tables of more than 2^31
    elements (9 sequences x 2M keys x 128): the last rows and sequences land where int32 offsets wrap."""
    n = (1 << 21) + 17
    q, w, k = inputs(1, 1040, 32, 128, n, 1, device="cuda")
    out = index_scores_kernel(q, w, k, 0.1)
    assert out.numel() > 2**31
    rows = [0, 1039]
    ref, mag = reference_scores(q[:, rows], w[:, rows], k, 0.1, key_chunk=1 << 18)
    assert_scores_close(out[:, rows], ref, mag)
    del out
    q, w, k = inputs(9, 1, 32, 128, n, 9, device="cuda", seed=1)
    assert k.numel() > 2**31
    out = index_scores_kernel(q, w, k, 0.1)
    ref, mag = reference_scores(q[8:], w[8:], k[8:], 0.1, key_chunk=1 << 18)
    assert_scores_close(out[8:], ref, mag)


@pytest.mark.gpu
@cuda
def test_matmul_fp32_half_gemm_on_cuda():
    """The torch path's GEMM: bf16 inputs, fp32 output (the fp32-output half GEMM, or the fp32 fallback),
    exact products: fp32 accuracy against fp64 (TF32 would be ~1e-3 off), for the shapes it is given."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1, 640, 128, generator=gen, device="cuda").bfloat16()
    keys = torch.randn(1, 3001, 128, generator=gen, device="cuda").bfloat16()
    got = matmul_fp32(a, keys.transpose(-1, -2))
    ref = a.double() @ keys.double().transpose(-1, -2)
    mag = a.double().abs() @ keys.double().abs().transpose(-1, -2)
    assert got.dtype == torch.float32 and got.shape == (1, 640, 3001)
    assert ((got.double() - ref).abs() / mag).max() <= 1e-5


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "b,t,n,key_batch,masked",
    [(1, 600, 40000, 1, False), (8, 1, 300001, 1, False), (2, 700, 2800, 2, True)],
    ids=["prompt-keys", "decode-rows", "own-keys-masked"],
)
def test_indexer_topk_kernel_equals_torch_path(monkeypatch, b, t, n, key_batch, masked):
    """The top-k sets through the kernel and through the torch path (LONGSTRAW_DISABLE=indexer_kernel), several
    merges each: equal on nearly every row, and where they differ, only by keys within the two paths' error
    bound (:func:`assert_scores_close`) of the row's k-th fp64 score (a near-tie either may break)."""
    monkeypatch.setattr(sparse, "TOPK_BUFFER_ELEMENTS", 9000 * b * t)  # 9000 keys per merge
    q, w, keys = inputs(b, t, 32, 128, n, key_batch, device="cuda", seed=t)
    key_pos = torch.arange(n, device="cuda") + 5
    q_pos = torch.arange(t, device="cuda") * 4 + 5 if masked else None
    k = 2048
    got = indexer_topk(q, w, keys, key_pos, q_pos, 128**-0.5, k)
    monkeypatch.setenv(DISABLE_ENV, ix.SWITCH)
    assert not ix.index_scores_kernel_available(q, keys)
    ref_s, ref_p = indexer_topk(q, w, keys, key_pos, q_pos, 128**-0.5, k)
    exact, mag = reference_scores(q, w, keys, 128**-0.5, q_pos, key_pos if masked else None)
    exact, mag = exact.flatten(0, 1), mag.flatten(0, 1)
    kth = exact.topk(k, -1).values[:, -1]
    equal = 0
    for i, (a, r) in enumerate(zip(_topk_sets(*got), _topk_sets(ref_s, ref_p), strict=True)):
        if a == r:
            equal += 1
            continue
        cols = torch.tensor(sorted(set(a) ^ set(r)), device="cuda") - 5
        near = (exact[i, cols] - kth[i]).abs() <= 2e-5 * mag[i, cols]
        assert near.all(), (i, cols[~near].tolist())
    assert equal >= 0.9 * exact.shape[0], (equal, exact.shape[0])
    close = (got[0].sort(-1).values - ref_s.sort(-1).values).abs().nan_to_num()
    assert (close <= 1e-5 * mag.amax(-1).view_as(close[..., 0]).unsqueeze(-1)).all()


@pytest.mark.gpu
@cuda
def test_glm_on_cuda_kernel_torch_path_offload_and_cuda_graph_decode(monkeypatch):
    """The tiny GLM-5 in bf16 on CUDA (a small top-k, so the indexer decides): the log-probs through the kernel
    and through the torch path agree; an offloaded state gives the resident one's log-probs, gradients and
    tokens (its decode step reads the chosen latent rows from mapped host memory, as one CUDA graph by
    default); decoding as one CUDA graph gives the eager tokens, and the graph really is captured (no eager
    fallback), resident or offloaded."""
    from _models import build_glm_dsa

    from longstraw_trl import capture_prompt
    from longstraw_trl.generation import DecodeStep
    from longstraw_trl.host_memory import streamed_bytes

    model = build_glm_dsa(index_topk=6).cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (300,), generator=gen).cuda()
    ids = torch.randint(0, 97, (2, 24), generator=gen).cuda()
    state = capture_prompt(model, prompt, chunk_size=128, page_size=64)
    kernel_lp = replay_logprobs(state, model, ids)
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, ix.SWITCH)
        torch_lp = replay_logprobs(capture_prompt(model, prompt, chunk_size=128, page_size=64), model, ids)
    assert (kernel_lp - torch_lp).abs().max() <= 2e-2, (kernel_lp - torch_lp).abs().max()

    offloaded = capture_prompt(model, prompt, chunk_size=128, page_size=64, offload_prompt_state="cpu")
    assert offloaded.layers[0].segments[0][0].is_pinned()
    assert torch.equal(replay_logprobs(offloaded, model, ids), kernel_lp)
    grads = []
    for s in (state, offloaded):
        model.zero_grad(set_to_none=True)
        replay_logprobs(s, model, ids[:1], grad=True).float().mean().backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0] and all(torch.isfinite(g).all() for g in grads[0].values())
    for name, g in grads[0].items():  # (the response part's gather backward adds with atomics: not bitwise)
        assert (g - grads[1][name]).norm() <= 2e-2 * g.norm() + 1e-6, name

    eager = generate_from_state(state, model, 4, 16, do_sample=False, cuda_graphs=False)
    graphed = generate_from_state(state, model, 4, 16, do_sample=False, cuda_graphs=True)
    assert torch.equal(eager, graphed)
    assert torch.equal(generate_from_state(offloaded, model, 4, 16, do_sample=False), eager)
    assert torch.equal(
        generate_from_state(offloaded, model, 4, 16, do_sample=False, cuda_graphs=False), eager
    )
    step = DecodeStep(model, state, 4, 8, cuda_graphs=True)
    step(state.last_token.view(1, 1).expand(4, 1))
    assert step.graph is not None, "the decode step's CUDA graph capture failed (eager fallback)"
    step = DecodeStep(model, offloaded, 4, 8, cuda_graphs=None)  # the default
    assert step.use_graphs, "an offloaded GLM-5 decode step streams nothing: it should be one CUDA graph"
    before = streamed_bytes()
    step(offloaded.last_token.view(1, 1).expand(4, 1))
    assert step.graph is not None, "the offloaded decode step's CUDA graph capture failed (eager fallback)"
    eager_step = streamed_bytes() - before
    step(eager[:, :1])  # a replay copies what the eager step copied, less its indexer keys (kept by the call)
    assert 0 < step.replay_streamed == streamed_bytes() - before - eager_step < eager_step
