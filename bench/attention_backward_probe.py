"""Flash's against cuDNN's attention backward at the full mode's prompt-segment shapes (Qwen3.6-27B: 24 q / 4 kv
heads, d = 256, bf16, a 16K-token segment), each fed the final merged out/LSE as the engine feeds them.

- pages: the segment's queries, grouped heads folded into rows (4 kv heads x 98,304 rows), against one 16K page
  whose dK/dV the full gradient needs;
- self: the segment's causal attention over its own keys (24 heads x 16K, K/V repeated to 24 heads).

Prints each backend's seconds and TFLOP/s (backward: 2.5x the forward's 4 T L d FLOPs a head, halved when
causal) and the relative difference of their dQ/dK/dV, and writes bench/results/attention_backward_probe.json.

    python bench/attention_backward_probe.py
"""

from __future__ import annotations

import argparse

import torch
from common import best_of, print_table, write_result

import longstraw_trl.kernels.attention.prompt_response as attn


def case(name: str, heads: int, rows: int, keys: int, causal: bool, d: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, rows, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(1, heads, keys, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)
    )
    dout = torch.randn(1, heads, rows, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = d**-0.5
    out, lse = attn.attention_lse(q, k, v, scale, causal=causal)
    flops = 2.5 * 4 * heads * rows * keys * d * (0.5 if causal else 1.0)
    grads, rows_out = {}, []
    # the forward with LSE at the same shape (the engine's path): the rate the floors use
    seconds = best_of(lambda: attn.attention_lse(q, k, v, scale, causal=causal), n=3)
    rows_out.append(
        {"case": name, "backend": "forward", "seconds": seconds, "tflops": flops / 2.5 / seconds / 1e12}
    )
    for backend, fn in (("flash", attn._flash_grads), ("cudnn", attn._cudnn_grads)):
        grads[backend] = fn(q, k, v, out, lse, dout, scale, causal)
        seconds = best_of(lambda fn=fn: fn(q, k, v, out, lse, dout, scale, causal), n=3)
        rows_out.append(
            {"case": name, "backend": backend, "seconds": seconds, "tflops": flops / seconds / 1e12}
        )
    diff = [((a - b).norm() / b.norm()).item() for a, b in zip(grads["cudnn"], grads["flash"], strict=True)]
    for r in rows_out:
        r["rel_diff_dq_dk_dv_cudnn_vs_flash"] = [round(x, 5) for x in diff]
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segment", type=int, default=16384)
    ap.add_argument("--page", type=int, default=None, help="keys of the page (default: --segment)")
    args = ap.parse_args()
    d, hq, hkv, t = 256, 24, 4, args.segment
    page = args.page or t
    rows = case("pages", hkv, hq // hkv * t, page, False, d) + case("self", hq, t, t, True, d)
    ok = {
        "flash_backward_ok": attn.flash_backward_ok(
            torch.empty(1, 1, 1, d, device="cuda", dtype=torch.bfloat16)
        )
    }
    ok["cudnn_backward_ok"] = attn.cudnn_backward_ok(
        torch.empty(1, 1, 1, d, device="cuda", dtype=torch.bfloat16)
    )
    print(ok)
    print_table(rows)
    write_result(
        "attention_backward_probe",
        {"segment": t, "page": page, "heads": [hq, hkv], "head_dim": d, **ok, "rows": rows},
    )


if __name__ == "__main__":
    main()
