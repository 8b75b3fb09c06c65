"""The Gated DeltaNet forward + backward of a full-mode prompt backward's capture chunk (Qwen3.6-27B: 16 q/k heads,
48 value heads of 128, bf16, a differentiable fp32 initial state and a final-state gradient): (a) the torch chunked
rule as the engine ran it so far, (b) fla's chunked forward/backward with our torch ``chunk_bwd_dqkwg``
(``LONGSTRAW_GDN_BACKWARD``, kernels/gdn_chunk_backward.py); each gradient of (b) against (a) on fp32 inputs; and
our step alone (its share of (b): the case for a Triton kernel of ours).

    PYTHONPATH=/tmp/site:/tmp/fla python bench/gdn_backward_probe.py --tokens 16384 65536
    python bench/gdn_backward_probe.py --smoke      # CPU, tiny dimensions: (a) and the step only
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
import torch.nn.functional as F
from common import best_of, peak_gib, print_table, reset_peak, write_result

from longstraw_trl.kernels.gated_delta_rule.chunk import fla_chunk_backward_ready, gated_delta_rule
from longstraw_trl.kernels.gated_delta_rule.chunk_backward import chunk_bwd_dqkwg_torch

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def inputs(tokens: int, heads: int, value_heads: int, dim: int, device: str, seed: int = 0):
    """q, k, v, g, beta, h0 as the engine passes them (bf16 projections, fp32 decay and state) and do, dht."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k, v = (rnd(1, tokens, h, dim).bfloat16() for h in (heads, heads, value_heads))
    g = F.logsigmoid(rnd(1, tokens, value_heads) + 3.0)
    beta = torch.rand(1, tokens, value_heads, device=device, generator=gen).bfloat16()
    h0 = 0.2 * rnd(1, value_heads, dim, dim)
    return [q, k, v, g, beta, h0], rnd(1, tokens, value_heads, dim), rnd(1, value_heads, dim, dim)


def forward_backward(backend: str, ins: list[torch.Tensor], do: torch.Tensor, dht: torch.Tensor) -> list:
    """Output, final state and the six gradients of one call as the engine's prompt backward makes it."""
    leaves = [t.detach().clone().requires_grad_(True) for t in ins]
    o, s = gated_delta_rule(
        *leaves[:5],
        initial_state=leaves[5],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        backend=backend,
        state_grad=True,
    )
    torch.autograd.backward([o, s], [do.to(o.dtype), dht])
    return [o.detach(), s.detach()] + [t.grad for t in leaves]


def step_seconds(tokens: int, heads: int, value_heads: int, dim: int, device: str) -> float:
    """Our ``chunk_bwd_dqkwg`` alone on fla's bf16 intermediates of this size (random values, same shapes)."""
    nt = -(-tokens // 64)
    gen = torch.Generator(device=device).manual_seed(1)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    g = -4 * torch.rand(1, tokens, value_heads, device=device, generator=gen)  # log2 decay within a chunk
    args = dict(
        q=rnd(1, tokens, heads, dim),
        k=rnd(1, tokens, heads, dim),
        v=rnd(1, tokens, value_heads, dim),
        do=rnd(1, tokens, value_heads, dim),
        h=rnd(1, nt, value_heads, dim, dim),
        dh=rnd(1, nt, value_heads, dim, dim),
        w=rnd(1, tokens, value_heads, dim),
        g=g,
        dv=rnd(1, tokens, value_heads, dim),
        scale=dim**-0.5,
    )
    return best_of(functools.partial(chunk_bwd_dqkwg_torch, **args))


def compare(got: list, ref: list) -> dict:
    """Max abs error, relative L2 (and the reference's max) of each output and gradient."""
    out = {}
    for name, a, b in zip(NAMES, got, ref, strict=True):
        a, b = a.double(), b.double()
        out[name] = {
            "max_abs_err": (a - b).abs().max().item(),
            "ref_max_abs": b.abs().max().item(),
            "rel_l2": ((a - b).norm() / b.norm().clamp_min(1e-30)).item(),
        }
    return out


def worst(errors: dict) -> float:
    return max(e["rel_l2"] for e in errors.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--smoke", action="store_true", help="dry run on CPU with tiny dimensions")
    args = ap.parse_args()
    heads, value_heads, dim, device = 16, 48, 128, "cuda"
    if args.smoke:
        args.tokens, heads, value_heads, dim, device = [100], 2, 6, 16, "cpu"
    new_path = device == "cuda" and fla_chunk_backward_ready()
    rows, results = [], []
    for tokens in args.tokens:
        ins, do, dht = inputs(tokens, heads, value_heads, dim, device)
        row: dict = {"tokens": tokens}
        try:
            reset_peak()
            row["torch_rule_s"] = best_of(functools.partial(forward_backward, "torch", ins, do, dht))
            row["torch_rule_peak_gib"] = peak_gib()
            if new_path:
                reset_peak()
                row["fla_ours_s"] = best_of(functools.partial(forward_backward, "fla", ins, do, dht))
                row["fla_ours_peak_gib"] = peak_gib()
                row["speedup"] = row["torch_rule_s"] / row["fla_ours_s"]
            row["dqkwg_step_s"] = step_seconds(tokens, heads, value_heads, dim, device)
            ref = forward_backward("torch", [t.float() for t in ins], do, dht)  # (a) on fp32 inputs
            # (a) in bf16 against it too: the error the engine's bf16 GDN had so far, for scale
            row["torch_rule_bf16_errors_vs_fp32"] = compare(forward_backward("torch", ins, do, dht), ref)
            row["torch_rule_bf16_worst_rel_l2"] = worst(row["torch_rule_bf16_errors_vs_fp32"])
            if new_path:
                row["errors_vs_fp32_torch_rule"] = compare(forward_backward("fla", ins, do, dht), ref)
                row["worst_rel_l2"] = worst(row["errors_vs_fp32_torch_rule"])
            del ref
        except torch.OutOfMemoryError as error:  # the 64K point where memory does not allow it
            row["out_of_memory"] = str(error).splitlines()[0]
        results.append(row)
        rows.append(
            {
                "tokens": tokens,
                "torch rule s": f"{row.get('torch_rule_s', math.nan):.3f}",
                "fla+ours s": f"{row.get('fla_ours_s', math.nan):.3f}",
                "speedup": f"{row.get('speedup', math.nan):.1f}x",
                "dqkwg step s": f"{row.get('dqkwg_step_s', math.nan):.4f}",
                "worst rel L2 (a bf16/b)": f"{row.get('torch_rule_bf16_worst_rel_l2', math.nan):.1e}/"
                f"{row.get('worst_rel_l2', math.nan):.1e}",
                "peak GiB (a/b)": f"{row.get('torch_rule_peak_gib', math.nan):.1f}/"
                f"{row.get('fla_ours_peak_gib', math.nan):.1f}",
            }
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    name = "gdn_backward_probe" + ("_smoke" if args.smoke else "")
    write_result(
        name,
        {
            "heads": heads,
            "value_heads": value_heads,
            "head_dim": dim,
            "dtype": "bfloat16",
            "new_path": new_path,
            "rows": results,
        },
    )
    print_table(rows)


if __name__ == "__main__":
    main()
