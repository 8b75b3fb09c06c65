"""kernels/runtime/compile_ahead.py: which manifest entries apply, finding each entry's kernel, and the worker protocol.

Compiling for real needs a GPU (Triton's ``JITFunction.preload`` binds to the active device): the GPU test records
a kernel's specialisation in one process and checks that a fresh process on an empty cache, compiling ahead, finds
the binary on disk instead of compiling it (Triton's compilation listener says which). On the CPU the workers run
and fail each entry (no driver), which checks that nothing waits on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from longstraw_trl.kernels.runtime import compile_ahead  # noqa: E402


def _manifest(tmp_path, gpu="TEST_GPU", triton_version=None, fla=None, entries=None):
    payload = {"gpu": gpu, "triton": triton_version or triton.__version__, "entries": entries or []}
    if fla is not None:
        payload["fla"] = fla
    (tmp_path / f"{gpu}.json").write_text(json.dumps(payload))
    return tmp_path


def _entry(module, qualname, spec="{}"):
    return {"module": module, "qualname": qualname, "specialization": spec}


def test_load_manifest_keeps_only_what_applies(tmp_path, monkeypatch):
    ours = _entry("longstraw_trl.kernels.attention.prompt_dq", "_kernel.<locals>.dq_kernel", '{"a": 1}')
    fla = _entry("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", '{"b": 2}')
    directory = _manifest(tmp_path, fla="0.6.0", entries=[ours, fla])
    monkeypatch.setattr(compile_ahead, "_versions", lambda: {"triton": triton.__version__, "fla": "0.6.0"})
    assert compile_ahead.load_manifest("TEST_GPU", directory) == [ours, fla]
    # another fla: its entries do not apply (its kernels' sources differ), ours still do
    monkeypatch.setattr(compile_ahead, "_versions", lambda: {"triton": triton.__version__, "fla": "0.7.0"})
    assert compile_ahead.load_manifest("TEST_GPU", directory) == [ours]
    # no fla installed
    monkeypatch.setattr(compile_ahead, "_versions", lambda: {"triton": triton.__version__})
    assert compile_ahead.load_manifest("TEST_GPU", directory) == [ours]
    # another Triton: nothing; another GPU: nothing
    monkeypatch.setattr(compile_ahead, "_versions", lambda: {"triton": "0.0.1", "fla": "0.6.0"})
    assert compile_ahead.load_manifest("TEST_GPU", directory) == []
    monkeypatch.setattr(compile_ahead, "_versions", lambda: {"triton": triton.__version__, "fla": "0.6.0"})
    assert compile_ahead.load_manifest("OTHER_GPU", directory) == []


def test_find_jit_function_module_level_and_inside_builders():
    """Outside Triton's interpreter (a subprocess): a kernel built inside a cached builder, one inside a namespace
    the builder returns, one inside a tuple, and a name that does not exist."""
    code = textwrap.dedent(
        """
        from longstraw_trl.kernels.runtime.compile_ahead import find_jit_function as find
        for module, name in [
            ("longstraw_trl.kernels.attention.prompt_dq", "_kernel.<locals>.dq_kernel"),
            ("longstraw_trl.kernels.elementwise.fused", "_kernels.<locals>.rms_norm_kernel"),
            ("longstraw_trl.kernels.gated_delta_rule.decode", "_kernels.<locals>.delta_kernel"),
            ("longstraw_trl.kernels.attention.prompt_dq", "_kernel.<locals>.no_such_kernel"),
            ("longstraw_trl.kernels.attention.prompt_dq", "no_such_builder"),
        ]:
            jit = find(module, name)
            print(None if jit is None else jit.fn.__qualname__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [
        "_kernel.<locals>.dq_kernel",
        "_kernels.<locals>.rms_norm_kernel",
        "_kernels.<locals>.delta_kernel",
        "None",
        "None",
    ]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU protocol: workers fail every entry without a GPU"
)
def test_workers_report_every_entry_and_nothing_waits(monkeypatch):
    """Without a GPU each worker reports ``failed`` for its entries (and a kernel that does not exist fails by
    name); every entry ends settled, so the step's hook never waits on them, and the previous hook still runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_cache_hook

    def earlier_hook(**kwargs):
        seen.append(kwargs["compile"]["specialization_data"])

    knobs.runtime.jit_cache_hook = earlier_hook
    try:
        entries = [
            _entry("longstraw_trl.kernels.attention.prompt_dq", "_kernel.<locals>.dq_kernel", '{"x": 1}'),
            _entry("longstraw_trl.kernels.attention.prompt_dq", "_kernel.<locals>.missing", '{"x": 2}'),
            _entry(
                "longstraw_trl.kernels.elementwise.fused", "_kernels.<locals>.rms_norm_kernel", '{"x": 3}'
            ),
        ]
        ahead = compile_ahead.CompileAhead(entries, workers=2, wait_s=60)
        assert ahead.wait(120), ahead.stats()
        stats = ahead.stats()
        assert stats["entries"] == 3 and stats["workers"] == 2
        assert stats["compiled_ahead"] == 0 and stats["failed"] == 3
        assert any("missing" in why and "LookupError" in why for why in stats["first_failures"]), stats
        # the step's hook: a settled entry does not wait; the earlier hook is chained
        ahead._hook(
            key=None,
            repr="",
            fn=None,
            compile={"specialization_data": '{"x": 1}'},
            is_manual_warmup=False,
            already_compiled=False,
        )
        assert seen == ['{"x": 1}'] and ahead.stats()["step_waits"] == 0
    finally:
        knobs.runtime.jit_cache_hook = previous


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_ahead_kernel_is_a_cache_hit(tmp_path):
    """Record the RMSNorm kernel's specialisation in one process; in a fresh process on an empty cache, compile it
    ahead in a worker, then run the kernel: Triton's listener sees a cache hit, not a compilation, and the host C
    compiler never runs (the worker built the kernel's launcher too)."""
    record = textwrap.dedent(
        """
        import json, sys, torch
        from longstraw_trl.kernels.runtime.compile_ahead import record_compilations
        from longstraw_trl.kernels.elementwise import fused as elementwise
        rec = record_compilations()
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
        elementwise.rms_norm(x, w, 1e-6, "llama")
        torch.cuda.synchronize()
        rec.dump(sys.argv[1])
        """
    )
    replay = textwrap.dedent(
        """
        import json, sys, torch, triton.runtime.build
        from pathlib import Path
        from triton import knobs
        from longstraw_trl.kernels.elementwise import fused as elementwise
        from longstraw_trl.kernels.runtime import compile_ahead
        entries = json.loads(Path(sys.argv[1]).read_text())["entries"]
        ahead = compile_ahead.CompileAhead(entries, workers=1)
        assert ahead.wait(300), ahead.stats()
        hits, built = [], []
        knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
        build = triton.runtime.build._build
        def counted_build(name, *args, **kwargs):
            built.append(name)
            return build(name, *args, **kwargs)
        triton.runtime.build._build = counted_build  # the host compiler: launchers and Triton's own utils
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
        elementwise.rms_norm(x, w, 1e-6, "llama")
        torch.cuda.synchronize()
        print(json.dumps({"stats": ahead.stats(), "hits": hits, "built": built}))
        """
    )
    manifest = tmp_path / "manifest.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache_record")
    subprocess.run([sys.executable, "-c", record, str(manifest)], env=env, check=True, timeout=300)
    assert json.loads(manifest.read_text())["entries"], "nothing recorded"
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache_fresh")
    out = subprocess.run(
        [sys.executable, "-c", replay, str(manifest)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["stats"]["compiled_ahead"] == result["stats"]["entries"] >= 1, result
    assert result["hits"] and all(result["hits"]), result  # found on disk, compiled by the worker
    assert result["built"] == [], result  # its launcher too: the step runs no C compiler
