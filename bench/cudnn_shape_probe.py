"""What a new key length costs the capture's cuDNN attention: first call (plan build) against warm calls.

Each capture chunk attends to a longer prefix than the last, so every chunk is a new shape for cuDNN. This times,
for a few prefix lengths, the first call and the best of three warm calls of the capture's prompt-part call
(16,384 queries of 24 heads folded onto 4 KV heads, head dim 256, bf16, with LSE), and the same for the causal
self part.

    python bench/cudnn_shape_probe.py --keys 131072 147456 163840
"""

from __future__ import annotations

import argparse

import torch
from common import Timer, write_result

from longstraw_trl.kernels.attention.prompt_response import _cudnn_lse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[131072, 147456, 163840])
    ap.add_argument("--queries", type=int, default=16384)
    args = ap.parse_args()
    dev = torch.device("cuda")
    q = torch.randn(1, 4, 6 * args.queries, 256, device=dev, dtype=torch.bfloat16)
    rows = []
    for n in args.keys:
        k = torch.randn(1, 4, n, 256, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        with Timer() as first:
            _cudnn_lse(q, k, v, 256**-0.5, False)
        warm = []
        for _ in range(3):
            with Timer() as t:
                _cudnn_lse(q, k, v, 256**-0.5, False)
            warm.append(t.seconds)
        tflops = 4 * q.shape[2] * n * 256 * 4 / min(warm) / 1e12
        rows.append({"keys": n, "first_s": first.seconds, "warm_s": min(warm), "warm_tflops": tflops})
        print(f"keys {n:>8}: first {first.seconds:.3f} s, warm {min(warm):.4f} s ({tflops:.0f} TFLOP/s)")
        del k, v
    write_result("cudnn_shape_probe", {"queries": args.queries, "rows": rows})


if __name__ == "__main__":
    main()
