"""The offloaded GLM-5 decode step's gather: a decode step's chosen latent rows (G x top-k of a million-row
table of 576-wide bf16 rows in page-locked host memory) brought to the GPU, every way the library can:

- the kernel (``kernels/host_gather.py``) reading the mapped host memory itself, at every tile of its ``TILES``,
  with the rows as the indexer chooses them (random), sorted, and one contiguous run (what the PCIe reads and the
  host's address translation cost apart);
- the torch path it replaces: indices to the host (a sync), the CPU's gather into pinned memory, one copy;
- a bulk host-to-device copy of the same bytes (the PCIe rate the other two are held to).

    python bench/host_gather_probe.py [--keys 1048576] [--rows 16384]
"""

from __future__ import annotations

import argparse
import functools

import torch
from common import best_of, write_result

import longstraw_trl.kernels.host_gather.gather as hg
from longstraw_trl.host_memory import pinned_empty

DIM = 576


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1 << 20, help="rows of the host table")
    ap.add_argument("--rows", type=int, default=8 * 2048, help="rows a gather brings (G x top-k)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    table = pinned_empty((args.keys, DIM), torch.bfloat16)
    table.copy_(torch.randn(args.keys, DIM).to(torch.bfloat16))
    gen = torch.Generator(device=dev).manual_seed(0)
    random_rows = torch.randint(0, args.keys, (args.rows,), device=dev, generator=gen)
    orders = {
        "random": random_rows,
        "sorted": random_rows.sort().values,
        "contiguous": torch.arange(args.rows, device=dev) + args.keys // 3,
    }
    nbytes = args.rows * DIM * 2
    expect = table[random_rows.cpu()]
    results = []

    def line(name: str, seconds: float) -> None:
        results.append({"case": name, "seconds": seconds, "gbs": nbytes / seconds / 1e9})
        print(f"{name:44s} {seconds * 1e3:8.3f} ms {nbytes / seconds / 1e9:7.1f} GB/s", flush=True)

    staged = torch.empty(args.rows, DIM, dtype=torch.bfloat16, pin_memory=True)
    line("bulk host-to-device copy", best_of(lambda: staged.to(dev, non_blocking=True), n=10))
    line(
        "torch path (sync, CPU gather, copy)",
        best_of(lambda: hg.gather_rows_reference(table, random_rows, dev)),
    )
    for tile in hg.TILES:
        got = hg.gather_rows_kernel(table, random_rows, tile=tile)
        assert torch.equal(got.cpu(), expect), tile
        for order, rows in orders.items():
            t = best_of(functools.partial(hg.gather_rows_kernel, table, rows, tile=tile), n=10)
            line(f"kernel {tile[0]} rows x {tile[1]} warps, {order}", t)
    best = min(
        (r for r in results if r["case"].endswith("random") and "kernel" in r["case"]),
        key=lambda r: r["seconds"],
    )
    print(f"best kernel tile at random rows: {best['case']} ({best['gbs']:.1f} GB/s)")
    write_result(
        "host_gather_probe",
        {
            "keys": args.keys,
            "rows": args.rows,
            "row_bytes": DIM * 2,
            "default_tile": list(hg.TILES[0]),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
