"""Engine on GLM-5 (``glm_moe_dsa``: MLA + DSA indexer with IndexShare) against the stock HF model.

fp32 on CPU; 4 layers (2 dense, 2 MoE; indexer types full, shared, full, shared: ``tests/_models.py``).
With ``index_topk`` at least the sequence length every visible key is selected; with a small ``index_topk``
the stock forward itself attends only to its selection, so on tie-free data (checked with HF's own formula)
the engine must select the same keys and give the same log-probs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from _models import build_glm_dsa
from _reference import (
    GRAD_VARIANTS,
    VOCAB,
    assert_grads_close,
    check_logprobs_against_stock,
    check_replay_grads,
    engine_grads,
    padded_completions,
    response_only_reference,
)
from _spawn import exit_worker, run_processes
from _state import assert_generate_matches_stock
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

import longstraw_trl.model_patches.glm_moe_dsa as glm
from longstraw_trl import (
    LongStrawError,
    UnsupportedModelError,
    capture_prompt,
    generate_from_state,
    patch_model,
    replay_logprobs,
)
from longstraw_trl.engine import ForwardContext, forward_model
from longstraw_trl.host_memory import streamed_bytes
from longstraw_trl.model_patches import (
    DeepseekV32Patch,
    GlmMoeDsaPatch,
    apply_longstraw_to_deepseek_v32,
    apply_longstraw_to_glm_moe_dsa,
    find_patch,
)
from longstraw_trl.model_patches.glm_moe_dsa import DSAPages
from longstraw_trl.planner import state_bytes

LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj"]
SMALL_TOPK = 6
# DeepSeek-V3.2 is served by the same patch (its indexer's RoPE is half-split; every layer indexes)
FAMILIES = ["glm_moe_dsa", "deepseek_v32"]


# ----------------------------------------------------------------------------------------------------
# The stock indexer's choices, and a tie check with HF's own formula
# ----------------------------------------------------------------------------------------------------
def _hf_index_scores(indexer, hidden_states, q_resid, position_embeddings, mask):
    """HF's GlmMoeDsaIndexer.forward / DeepseekV32Indexer.forward up to their top-k (transformers 5.23): the
    same but for the RoPE (interleaved pairs / half-split)."""
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    rope = indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    rope = (
        hf.apply_rotary_pos_emb_interleave
        if isinstance(indexer, hf.GlmMoeDsaIndexer)
        else ds.apply_rotary_pos_emb
    )
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)
    scores = torch.relu(
        torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale
    )
    w = indexer.weights_proj(hidden_states).float() * indexer.n_heads**-0.5
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2) + mask


@contextlib.contextmanager
def stock_choices():
    """Record the stock indexer's top-k per full layer (``{layer: [B, S, k]}``) and assert that every query's
    k-th and (k+1)-th visible scores differ (tie-free: the top-k set is then unique)."""
    record: dict[int, torch.Tensor] = {}
    stocks = {cls: cls.forward for cls in (hf.GlmMoeDsaIndexer, ds.DeepseekV32Indexer)}

    # the cache argument is `past_key_values` up to transformers 5.24, `cache` from 5.25: passed on as given
    def spy(
        self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, *cache, **kw_cache
    ):
        out = stocks[type(self)](
            self,
            hidden_states,
            q_resid,
            position_embeddings,
            attention_mask,
            position_ids,
            *cache,
            **kw_cache,
        )
        assert all(c is None for c in (*cache, *kw_cache.values())), (
            "run the stock forward with use_cache=False"
        )
        s = _hf_index_scores(self, hidden_states, q_resid, position_embeddings, attention_mask)
        top = s.topk(min(self.index_topk + 1, s.shape[-1]), dim=-1).values
        for i in range(self.index_topk, s.shape[-1]):  # queries that see more than topk keys
            gap = top[:, i, self.index_topk - 1] - top[:, i, self.index_topk]
            assert (gap > 1e-4).all(), f"tie at the top-k boundary (layer {self.layer_idx}, query {i})"
        record[self.layer_idx] = out
        return out

    for cls in stocks:
        cls.forward = spy
    try:
        yield record
    finally:
        for cls, stock in stocks.items():
            cls.forward = stock


@contextlib.contextmanager
def engine_choices():
    """Record the engine's selection per full layer (the last call's)."""
    record: dict[int, glm.DSASelection] = {}
    select = glm._select

    def spy(indexer, *args, **kwargs):
        record[indexer.layer_idx] = sel = select(indexer, *args, **kwargs)
        return sel

    glm._select = spy
    try:
        yield record
    finally:
        glm._select = select


def _selected_positions(sel: glm.DSASelection, resident: int, row: int, query: int) -> set[int]:
    p, s = sel.prompt_rows[row, query], sel.self_rows[row, query]
    return set(p[p >= 0].tolist()) | set((s[s >= 0] + resident).tolist())


# ----------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len,chunk,page",
    [(1, 8, 4), (5, 16, 4), (37, 8, 5), (30, 7, 3)],
    ids=["one-token", "one-chunk", "uneven", "many-pages"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_stock_forward_all_keys_selected(prompt_len, chunk, page, family):
    state = check_logprobs_against_stock(
        build_glm_dsa(index_topk=2048, family=family), prompt_len, chunk, page
    )
    assert all(type(layer) is DSAPages for layer in state.layers.values())
    assert len(state.layers) == (0 if prompt_len == 1 else 4)


# YaRN with mscale_all_dim: the softmax scale is qk_head_dim ** -0.5 times mscale ** 2 (HF's yarn_apply_mscale)
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, mscale_all_dim=1.0
)


@pytest.mark.parametrize(
    "prompt_len,chunk,page,rope",
    [(29, 8, 5, None), (40, 16, 7, None), (33, 8, 4, YARN)],
    ids=["29", "40", "yarn-mscale"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_small_topk_selects_the_stock_keys_and_matches_stock(prompt_len, chunk, page, rope, family):
    """index_topk < sequence length: on tie-free data the engine picks the stock indexer's keys for every response
    query of every full layer, and the log-probs equal the stock full forward (which attends to that selection)."""
    model = build_glm_dsa(index_topk=SMALL_TOPK, family=family, **({"rope_parameters": rope} if rope else {}))
    if rope:
        attn = model.model.layers[0].self_attn
        assert attn.scaling > attn.qk_head_dim**-0.5  # the mscale is on
    gen = torch.Generator().manual_seed(prompt_len + (0 if family == "glm_moe_dsa" else 100))  # tie-free data
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    comp = torch.randint(0, VOCAB, (9,), generator=gen)
    with stock_choices() as ref_sel, torch.no_grad():
        full = torch.cat([prompt, comp])[None]
        logits = model(full, use_cache=False).logits.float()
    ref = torch.log_softmax(logits[:, prompt_len - 1 : -1], -1).gather(-1, comp[None, :, None])[0, :, 0]
    state = capture_prompt(model, prompt, chunk_size=chunk, page_size=page)
    with engine_choices() as sel:
        got = replay_logprobs(state, model, comp[None])[0]
    assert sorted(sel) == sorted(ref_sel) == ([0, 2] if family == "glm_moe_dsa" else [0, 1, 2, 3])
    resident = state.resident_tokens
    for layer, choice in sel.items():
        for i in range(comp.numel()):
            stock = {x for x in ref_sel[layer][0, resident + i].tolist() if x <= resident + i}
            assert _selected_positions(choice, resident, 0, i) == stock, (layer, i)
    assert (got - ref).abs().max().item() <= 1e-4


def test_tiled_indexer_and_attention_equal_stock(monkeypatch):
    """The score tiles, the top-k buffers and the attention query blocks at a few elements each (at real sizes
    they hold 2^28 and 2^27 scores and 256 query rows): the same choices and log-probs as the stock forward."""
    import longstraw_trl.kernels.sparse_attention.dsa as sparse

    monkeypatch.setattr(sparse, "SCORE_TILE_ELEMENTS", 16 * 3 * 5)  # 3 keys per tile at 5 queries of 16 heads
    monkeypatch.setattr(sparse, "TOPK_BUFFER_ELEMENTS", 5 * 7)  # 7 keys per top-k merge at 5 queries
    monkeypatch.setattr(sparse, "ATTENTION_QUERY_ROWS", 3)
    test_small_topk_selects_the_stock_keys_and_matches_stock(29, 8, 5, None, "glm_moe_dsa")
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    gen = torch.Generator().manual_seed(1)
    prompt, completion = (
        torch.randint(0, VOCAB, (26,), generator=gen),
        torch.randint(0, VOCAB, (7,), generator=gen),
    )
    weights = torch.randn(7, generator=gen)
    state = capture_prompt(model, prompt, chunk_size=9, page_size=4)
    got = engine_grads(model, state, completion, weights)
    assert_grads_close(got, response_only_reference(model, prompt, completion, weights))


def test_small_topk_capture_selects_the_stock_keys():
    """Inside the capture too (prompt queries over earlier chunks' pages + their own chunk): same choices."""
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    prompt = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(2))
    with stock_choices() as ref_sel, torch.no_grad():
        model(prompt[None, :-1], use_cache=False)
    chunks = []
    select = glm._select

    def spy(indexer, *args, **kwargs):
        sel = select(indexer, *args, **kwargs)
        chunks.append((indexer.layer_idx, args[4], sel))  # args[4]: tokens resident before the chunk
        return sel

    glm._select = spy
    try:
        capture_prompt(model, prompt, chunk_size=10, page_size=4)
    finally:
        glm._select = select
    assert len(chunks) == 2 * 4  # 2 full layers x 4 chunks of the 32 resident tokens
    for layer, resident, sel in chunks:
        for i in range(sel.self_rows.shape[1]):
            stock = {x for x in ref_sel[layer][0, resident + i].tolist() if x <= resident + i}
            assert _selected_positions(sel, resident, 0, i) == stock, (layer, resident + i)


# ----------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_grads_match_response_only_reference(variant):
    got = check_replay_grads(build_glm_dsa(index_topk=2048), variant, LORA_TARGETS)
    if variant == "lora":
        assert all("lora_" in n for n in got)
        assert any("kv_b_proj.lora" in n for n in got)  # the absorbed weights carry the adapter
    else:
        assert any("indexer" in n for n in dict(build_glm_dsa().named_parameters()))
        assert not any("indexer" in n for n in got)  # gradient-free, as in HF


@pytest.mark.parametrize("family", FAMILIES)
def test_grads_with_small_topk_match_response_only_reference(family):
    model = build_glm_dsa(index_topk=SMALL_TOPK, family=family)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (29,), generator=gen)
    completion = torch.randint(0, VOCAB, (11,), generator=gen)
    weights = torch.randn(11, generator=gen)
    state = capture_prompt(model, prompt, chunk_size=8, page_size=6)
    got = engine_grads(model, state, completion, weights)
    assert_grads_close(got, response_only_reference(model, prompt, completion, weights))


# ----------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [9, 41])
def test_nbytes_by_kind_has_mla_and_indexer_as_the_formula(prompt_len):
    model = build_glm_dsa()
    config = model.config
    state = capture_prompt(model, torch.randint(0, VOCAB, (prompt_len,)), chunk_size=16, page_size=8)
    n, full = prompt_len - 1, config.indexer_types.count("full")
    expected = {
        "mla": config.num_hidden_layers * n * (config.kv_lora_rank + config.qk_rope_head_dim) * 4,
        "indexer": full * n * config.index_head_dim * 4,
    }
    assert state.nbytes_by_kind() == expected
    assert state_bytes(config, prompt_len, 1, 8, dtype_bytes=4) == expected
    assert state.nbytes() == sum(expected.values())


def test_offloaded_state_of_three_pages_equals_resident(monkeypatch):
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (25,), generator=gen)  # 24 resident tokens: 3 pages of 8
    ids, mask = padded_completions([7, 5], gen)
    resident = capture_prompt(model, prompt, chunk_size=16, page_size=8)
    offloaded = capture_prompt(model, prompt, chunk_size=16, page_size=8, offload_prompt_state="cpu")
    layer = offloaded.layers[0]
    assert layer.offloaded and len(list(layer.stream(torch.device("cpu")))) == 3
    assert offloaded.nbytes_by_kind() == resident.nbytes_by_kind()
    assert torch.equal(
        replay_logprobs(resident, model, ids, mask), replay_logprobs(offloaded, model, ids, mask)
    )
    g = [engine_grads(model, s, ids[0], torch.linspace(-1, 1, 7)) for s in (resident, offloaded)]
    assert_grads_close(g[1], g[0], tol=1e-6)
    # decoding reads only the chosen latent rows of an offloaded layer (2 x top-6 < 24 stored tokens)
    tokens = torch.randint(0, VOCAB, (2, 4), generator=gen)
    gathers = []  # the host rows of every gather: one host copy a selection, shared layers reuse it
    gather = glm.host_rows_to_device
    monkeypatch.setattr(
        glm, "host_rows_to_device", lambda h, rows, d: gathers.append(rows) or gather(h, rows, d)
    )
    logits, streamed = [], []  # bytes copied from the host before each step and after the last
    with torch.no_grad():
        for state in (resident, offloaded):
            ctx = ForwardContext("decode", state, capacity=4)
            steps = []
            for i in range(4):
                streamed.append(streamed_bytes())
                steps.append(forward_model(model, tokens[:, i : i + 1], 24 + i, ctx))
            streamed.append(streamed_bytes())
            logits.append(torch.cat(steps, 1))
    assert (logits[0] - logits[1]).abs().max() <= 1e-6
    # the offloaded decode copies the indexer keys once (the first step), then only each step's chosen rows
    row_bytes = [r.numel() * layer.head_dim * layer.dtype.itemsize for r in gathers]
    per_step = len(gathers) // 4
    steps = [sum(row_bytes[j * per_step : (j + 1) * per_step]) for j in range(4)]
    copied = [b - a for a, b in zip(streamed[5:9], streamed[6:10], strict=True)]
    assert streamed[5] == streamed[0]  # (nothing streamed from the resident state)
    assert copied == [steps[0] + offloaded.nbytes_by_kind()["indexer"], *steps[1:]]
    layers = model.config.num_hidden_layers
    full = glm._indexer_types(model.config).count(glm.FULL_INDEXER)
    assert len(gathers) == 4 * layers and len({id(r) for r in gathers}) == 4 * full < len(gathers)
    torch.manual_seed(0)
    a = generate_from_state(resident, model, 2, 5, do_sample=True, pad_token_id=0)
    torch.manual_seed(0)
    assert torch.equal(generate_from_state(offloaded, model, 2, 5, do_sample=True, pad_token_id=0), a)


def test_offloaded_decode_gathers_on_the_device_without_a_host_sync(monkeypatch):
    """With the GPU's gather of mapped host memory (here its kernel under Triton's interpreter, the CUDA check
    faked), an offloaded decode step brings no index to the host and streams no page: it decodes the resident
    state's tokens, also with more chosen slots (5 x top-6) than stored tokens (24), and is graphable
    (``decode_streams`` False). Without the kernel it streams (eager)."""
    pytest.importorskip("triton")
    import longstraw_trl.kernels.host_gather.gather as hg
    from longstraw_trl import host_memory

    model = build_glm_dsa(index_topk=SMALL_TOPK)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (25,), generator=gen)
    resident = capture_prompt(model, prompt, chunk_size=16, page_size=8)
    offloaded = capture_prompt(model, prompt, chunk_size=16, page_size=8, offload_prompt_state="cpu")
    cpu = torch.device("cpu")
    assert all(layer.decode_streams(cpu) for layer in offloaded.layers.values())  # no kernel on the CPU
    assert not any(layer.decode_streams(cpu) for layer in resident.layers.values())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hg._kernel.cache_clear()
    faked = lambda table, rows, device: table.dim() == 2  # noqa: E731
    monkeypatch.setattr(glm, "gather_rows_kernel_available", faked)
    monkeypatch.setattr(host_memory, "gather_rows_kernel_available", faked)
    kernel_calls, host_rows = [], []
    kernel = host_memory.gather_rows_kernel
    monkeypatch.setattr(host_memory, "gather_rows_kernel", lambda *a: kernel_calls.append(1) or kernel(*a))
    index = glm.DSASelection.gather_index

    def gather_index(self, host, device):
        out = index(self, host, device)
        host_rows.append(self._host_rows is not None)  # (set when the rows were copied to the host)
        return out

    monkeypatch.setattr(glm.DSASelection, "gather_index", gather_index)
    pages = []  # latent pages streamed whole (a graph could not hold their copies)
    materialize = glm._materialize
    monkeypatch.setattr(
        glm, "_materialize", lambda layer, d, part: pages.append(part) or materialize(layer, d, part)
    )
    try:
        assert not any(layer.decode_streams(cpu) for layer in offloaded.layers.values())
        for g in (2, 5):
            torch.manual_seed(0)
            a = generate_from_state(resident, model, g, 5, do_sample=True, pad_token_id=0)
            pages.clear()
            torch.manual_seed(0)
            assert torch.equal(
                generate_from_state(offloaded, model, g, 5, do_sample=True, pad_token_id=0), a
            ), g
            assert 0 not in pages and pages, (
                g,
                pages,
            )  # the indexer keys (part 1) once a call, no latent page
        assert kernel_calls and host_rows and not any(host_rows)
    finally:
        hg._kernel.cache_clear()


# ----------------------------------------------------------------------------------------------------
# Decode and generation
# ----------------------------------------------------------------------------------------------------
def test_decode_token_by_token_equals_replay():
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    gen = torch.Generator().manual_seed(4)
    state = capture_prompt(model, torch.randint(0, VOCAB, (19,), generator=gen), chunk_size=8, page_size=8)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
    start = state.resident_tokens
    with torch.no_grad():
        for step in (
            None,
            torch.zeros((), dtype=torch.long),
        ):  # growing buffers, and fixed shapes (CUDA graphs)
            ctx = ForwardContext("decode", state, capacity=6, step=step)
            steps = []
            for i in range(6):
                steps.append(forward_model(model, tokens[:, i : i + 1], start + i, ctx))
                if step is not None:
                    step.add_(1)
            replayed = forward_model(model, tokens, start, ForwardContext("replay", state))
            assert (torch.cat(steps, dim=1) - replayed).abs().max().item() <= 1e-5


@pytest.mark.parametrize("topk", [SMALL_TOPK, 2048])
@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=20)])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_stock_generate(topk, sampling, family):
    model = build_glm_dsa(index_topk=topk, family=family)
    prompt = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(6))
    assert_generate_matches_stock(model, prompt, 8, 5, sampling)


# ----------------------------------------------------------------------------------------------------
# Context parallelism (2 gloo processes)
# ----------------------------------------------------------------------------------------------------
def _cp_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = build_glm_dsa(index_topk=SMALL_TOPK)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, VOCAB, (30,), generator=gen)
        ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
        mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
        single = capture_prompt(model, prompt, chunk_size=8, page_size=4)
        sharded = capture_prompt(model, prompt, chunk_size=8, page_size=4, cp_group=dist.group.WORLD)
        total = torch.tensor([sharded.nbytes()])
        dist.all_reduce(total)
        assert int(total) == single.nbytes() and sharded.nbytes() < single.nbytes()
        if rank == 0:  # the planner's per-rank state is the first rank's (it holds the most pages)
            assert sharded.nbytes_by_kind() == state_bytes(model.config, 30, 2, 4, dtype_bytes=4)
        diff = (replay_logprobs(single, model, ids, mask) - replay_logprobs(sharded, model, ids, mask)) * mask
        assert diff.abs().max() <= 1e-5, diff.abs().max()
        w = torch.linspace(-1, 1, 7)
        g1, g2 = (engine_grads(model, s, ids[0], w) for s in (single, sharded))
        assert_grads_close(g2, g1, tol=1e-5)
        torch.manual_seed(3)
        a = generate_from_state(single, model, 2, 5, do_sample=False, pad_token_id=0)
        torch.manual_seed(3)
        b = generate_from_state(sharded, model, 2, 5, do_sample=False, pad_token_id=0)
        assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_context_parallel_two_ranks_equal_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        run_processes(_cp_worker, (2, os.path.join(tmp, "init")), nprocs=2)


# ----------------------------------------------------------------------------------------------------
# Patching and validation
# ----------------------------------------------------------------------------------------------------
def test_patch_is_idempotent_and_leaves_stock_forward_alone():
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    x = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        before = model(x).logits
        apply_longstraw_to_glm_moe_dsa(model)
        patch_model(model)
        after = model(x).logits
    assert torch.equal(before, after)
    assert isinstance(find_patch(model), GlmMoeDsaPatch)
    ds_model = build_glm_dsa(index_topk=SMALL_TOPK, family="deepseek_v32")
    with torch.no_grad():
        before = ds_model(x).logits
        apply_longstraw_to_deepseek_v32(ds_model)
        assert torch.equal(before, ds_model(x).logits)
    assert type(find_patch(ds_model)) is DeepseekV32Patch
    with pytest.raises(UnsupportedModelError, match="deepseek_v32"):
        apply_longstraw_to_glm_moe_dsa(ds_model)


def test_state_of_another_model_is_rejected():
    model = build_glm_dsa()
    other = build_glm_dsa(indexer_types=["full", "full", "full", "shared"])
    state = capture_prompt(model, torch.randint(0, VOCAB, (9,)), chunk_size=8, page_size=4)
    with pytest.raises(LongStrawError, match="indexer"):
        replay_logprobs(state, other, torch.randint(0, VOCAB, (1, 3)))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(indexer_types=["shared", "full", "full", "shared"]), "first layer must run its indexer"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_unsupported_options_raise(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        patch_model(build_glm_dsa(**change))


def test_capture_compacts_the_chosen_rows_and_nothing_else_does(monkeypatch):
    """A capture chunk's selection keeps each query's chosen rows first, trimmed to the widest count (the same
    sets); generation and replays keep the full width (the compaction syncs with the host)."""
    rows = torch.tensor([[[3, -1, 5, -1], [-1, -1, -1, -1], [-1, 7, -1, -1]]])
    got = glm._compact_rows(rows)
    assert got.shape == (1, 3, 2)
    assert [set(r.tolist()) - {-1} for r in got[0]] == [{3, 5}, set(), {7}]
    assert glm._compact_rows(torch.full((1, 2, 3), -1)).shape == (1, 2, 1)  # nothing chosen: one empty slot
    full = torch.arange(6).view(1, 2, 3)
    assert glm._compact_rows(full) is full

    calls = []
    real = glm._compact_rows

    def recording(r):
        out = real(r)
        calls.append(out.shape)
        return out

    monkeypatch.setattr(glm, "_compact_rows", recording)
    model = build_glm_dsa(index_topk=SMALL_TOPK)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4))
    state = capture_prompt(model, prompt, chunk_size=8, page_size=8)
    assert calls and all(s[-1] <= SMALL_TOPK for s in calls)
    assert any(s[-1] < SMALL_TOPK for s in calls)  # the self rows of a chunk past the first: trimmed
    calls.clear()
    replay_logprobs(state, model, torch.randint(0, VOCAB, (1, 5)), grad=True).sum().backward()
    generate_from_state(state, model, 2, 3, do_sample=False)
    assert calls == []


def test_trainer_binds_lora_on_the_experts():
    """peft's "all-linear" on a MoE model converted from transformers v4 wraps the fused expert weights in a
    ``ParamWrapper``; the trainer's model check binds their activation-form forward (one a MoE block), and
    names none for attention-only targets."""
    from peft import LoraConfig, get_peft_model

    from longstraw_trl.trainer import _bind_expert_adapters

    attention = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    for targets, blocks in (("all-linear", 2), (attention, 0)):
        model = get_peft_model(build_glm_dsa(index_topk=SMALL_TOPK), LoraConfig(r=2, target_modules=targets))
        _bind_expert_adapters(model)
        bound = [n for n, m in model.named_modules() if "forward" in m.__dict__ and n.endswith("mlp.experts")]
        assert len(bound) == blocks, (targets, bound)
