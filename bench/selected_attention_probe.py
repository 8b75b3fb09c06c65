"""GLM-5's attention over each query's chosen latent rows: the fused Triton kernel
(``kernels/selected_keys_attention.py``) against the torch path it replaces (rows gathered, two batched GEMMs),
graph-free, at GLM-5's sizes (64 heads, latent keys of 576 with values of 512, bf16), at the shapes a capture
chunk's prompt part, its own keys and a replay batch's prompt part take.

    python bench/selected_attention_probe.py --keys 1048576 [--tiles]

``--tiles``: every tile of ``kernels.selected_keys_attention.TILES`` at each case (the default is the first).
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
from common import best_of, write_result

import longstraw_trl.kernels.sparse_attention.selected_keys as ska
from longstraw_trl.kernels.sparse_attention import selected_attention

HEADS, DIM, VALUE_DIM = 64, 576, 512


def torch_path(q, table, rows, scale):
    os.environ[ska.KERNEL_ENV] = "0"
    try:
        return selected_attention(q, table, rows, scale, VALUE_DIM)
    finally:
        del os.environ[ska.KERNEL_ENV]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1 << 20, help="prompt rows of the shared table")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument(
        "--tiles", action="store_true", help="time every tile of the kernel, not only the default"
    )
    args = ap.parse_args()
    dev, scale = torch.device("cuda"), 256**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    table = torch.randn(args.keys, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    own = torch.randn(1, 16384, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    cases = [  # name, batch, queries, table, chosen per query, rows drawn from
        ("capture chunk, prompt part (a quarter chunk)", 1, 4096, table, args.topk, args.keys),
        ("capture chunk, its own keys (compacted to 256)", 1, 16384, own, 256, 16384),
        ("replay batch of 8, prompt part", 8, 257, table, args.topk, args.keys),
    ]
    out_rows = []
    with torch.no_grad():
        for name, b, t, tab, k, n in cases:
            q = torch.randn(b, HEADS, t, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
            rows = torch.randint(0, n, (b, t, k), device=dev, generator=gen)
            if tab.dim() == 3:  # a chunk's own keys: half the compacted slots hold none
                rows[..., k // 2 :] = -1
            assert ska.selected_attention_kernel_ok(q, tab, rows), "the kernel does not serve this case"
            t_torch = best_of(functools.partial(torch_path, q, tab, rows, scale))
            t_kernel = best_of(functools.partial(selected_attention, q, tab, rows, scale, VALUE_DIM))
            ref, ref_lse = torch_path(q, tab, rows, scale)
            got, got_lse = selected_attention(q, tab, rows, scale, VALUE_DIM)
            flops = 2 * b * t * HEADS * k * (DIM + VALUE_DIM)
            gathered = b * t * k * DIM * 2  # bytes of the chosen rows, as the torch path materialises them
            by_tile = {}
            for tile in ska.TILES if args.tiles else ():
                got_t, _ = ska.selected_attention_kernel(q, tab, rows, scale, VALUE_DIM, tile=tile)
                seconds = best_of(
                    functools.partial(
                        ska.selected_attention_kernel, q, tab, rows, scale, VALUE_DIM, tile=tile
                    )
                )
                by_tile["x".join(map(str, tile))] = {
                    "kernel_s": seconds,
                    "speedup": t_torch / seconds,
                    "relative_difference": ((got_t - ref).norm() / ref.norm()).item(),
                }
                print(f"  tile {tile}: {seconds * 1e3:8.2f} ms ({t_torch / seconds:.2f}x)")
            row = {
                "case": name,
                "batch": b,
                "queries": t,
                "chosen_per_query": k,
                "table_rows": tab.shape[-2],
                "torch_s": t_torch,
                "kernel_s": t_kernel,
                "speedup": t_torch / t_kernel,
                "kernel_tflops": flops / t_kernel / 1e12,
                "kernel_rows_gb_per_s": gathered / t_kernel / 1e9,
                "relative_difference": ((got - ref).norm() / ref.norm()).item(),
                "lse_max_abs_difference": (got_lse - ref_lse).abs().max().item(),
                "default_tile": "x".join(map(str, ska.TILES[0])),
                "by_tile": by_tile,
            }
            out_rows.append(row)
            print(
                f"{name}: torch {t_torch * 1e3:8.2f} ms, kernel {t_kernel * 1e3:8.2f} ms ({row['speedup']:.2f}x, "
                f"{row['kernel_tflops']:.0f} TFLOP/s, rows read {row['kernel_rows_gb_per_s']:.0f} GB/s), rel diff "
                f"{row['relative_difference']:.1e}"
            )
    write_result("selected_attention_probe", {"rows": out_rows})


if __name__ == "__main__":
    main()
