"""The replay's dQ over prompt pages: the query-parallel Triton kernel (``kernels/prompt_dq.py``) against the flash
backward op it replaces, at replay shapes (24 q / 4 kv heads folded, d = 256, bf16, prompt keys as one segment).

    python bench/prompt_dq_probe.py --keys 524288 --responses 1 8
"""

from __future__ import annotations

import argparse
import functools

import torch
from common import best_of, write_result

from longstraw_trl.kernels.attention.prompt_response import _flash_grads
from longstraw_trl.kernels.attention.prompt_dq import prompt_dq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[524288])
    ap.add_argument("--responses", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--response-tokens", type=int, default=257)
    args = ap.parse_args()
    dev, h, d, rep = torch.device("cuda"), 4, 256, 6
    rows_out = []
    for n in args.keys:
        k = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for g in args.responses:
            m = g * rep * args.response_tokens
            q = torch.randn(1, h, m, d, device=dev, dtype=torch.bfloat16)
            dout = torch.randn_like(q)
            out = torch.randn(1, h, m, d, device=dev, dtype=torch.float32) * 0.05
            lse = torch.full((1, h, m), 12.0, device=dev)  # a normaliser over far more keys than these
            delta = (dout.float() * out).sum(-1)
            flash = best_of(functools.partial(_flash_grads, q, k, v, out, lse, dout, d**-0.5, False))
            ours = best_of(functools.partial(prompt_dq, q[0], k[0], v[0], lse[0], delta[0], dout[0], d**-0.5))
            dq_flops = 3 * 2 * m * n * d * h
            row = {
                "keys": n,
                "responses": g,
                "query_rows_per_kv_head": m,
                "flash_backward_s": flash,
                "prompt_dq_s": ours,
                "speedup": flash / ours,
                "prompt_dq_tflops_dq_only": dq_flops / ours / 1e12,
            }
            # agreement on these inputs (both compute the same dQ)
            ref = _flash_grads(q, k, v, out, lse, dout, d**-0.5, False)[0][0]
            got = prompt_dq(q[0], k[0], v[0], lse[0], delta[0], dout[0], d**-0.5)
            row["relative_difference"] = ((got - ref).norm() / ref.norm()).item()
            rows_out.append(row)
            print(
                f"keys {n:>8} responses {g}: flash bwd {flash * 1e3:7.2f} ms, prompt_dq {ours * 1e3:7.2f} ms "
                f"({row['speedup']:.2f}x, {row['prompt_dq_tflops_dq_only']:.0f} TFLOP/s), rel diff "
                f"{row['relative_difference']:.1e}"
            )
    write_result("prompt_dq_probe", {"rows": rows_out})


if __name__ == "__main__":
    main()
