"""The kernel switches: fast paths that one environment variable turns off, for comparison or as a workaround.

``LONGSTRAW_DISABLE`` holds a comma-separated list of switch names (any case, spaces ignored), e.g.
``LONGSTRAW_DISABLE=gdn_decode,prompt_dq``; every path it does not name is on. An unknown name raises, listing the
valid ones (:data:`SWITCHES`). It is read here only, on each query (a test may change it between calls).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

__all__ = ["DISABLE_ENV", "SWITCHES", "disabled", "enabled", "kernel_builds"]

DISABLE_ENV = "LONGSTRAW_DISABLE"

SWITCHES = {
    "autotune_pins": "this GPU's pinned Triton autotuning choices (off: autotune on the first call)",
    "compile_ahead": "compiling the recorded kernel specialisations ahead in worker processes",
    "cpu_flash": "CPU attention in blocks with an online softmax (off: the plain torch math)",
    "cuda_graphs": "the decode step as a CUDA graph (off: eager decode steps)",
    "cudnn_backward": "cuDNN's attention backward where it applies (off: flash's backward)",
    "fla_conv": "the capture's GDN conv on fla's Triton causal_conv1d (off: torch)",
    "gdn_backward": "GDN backward through fla's chunked kernels (off: the torch chunked rule)",
    "gdn_decode": "the fused GDN decode step (off: the torch step)",
    "host_gather_kernel": "the GPU gather of an offloaded GLM-5 state's chosen rows (off: gathered on the host)",
    "indexer_kernel": "the fused DSA indexer scores (off: the torch reference)",
    "prompt_dq": "the replay's dQ over the prompt pages in one kernel (off: the flash backward)",
    "selected_attention_kernel": "GLM-5's fused selected-keys attention (off: torch gathers and GEMMs)",
    "torch_dqkwg": (
        "our torch chunk_bwd_dqkwg in fla's GDN backward (off: fla's own kernel, outside the Hopper + Triton "
        "3.4-3.7.0 range where it is miscompiled)"
    ),
}
"""Every switch name, with the path it turns off."""


@functools.lru_cache(maxsize=16)
def _parse(value: str) -> frozenset[str]:
    names = frozenset(part.strip().lower() for part in value.split(",") if part.strip())
    unknown = sorted(names - SWITCHES.keys())
    if unknown:
        raise ValueError(
            f"{DISABLE_ENV} names unknown kernel switch(es) {', '.join(unknown)}; valid names: "
            f"{', '.join(sorted(SWITCHES))}."
        )
    return names


def disabled() -> frozenset[str]:
    """The switch names ``LONGSTRAW_DISABLE`` turns off (raises ``ValueError`` on a name not in :data:`SWITCHES`)."""
    return _parse(os.environ.get(DISABLE_ENV, ""))


def enabled(name: str) -> bool:
    """Whether the fast path of switch ``name`` (a key of :data:`SWITCHES`) is on."""
    if name not in SWITCHES:
        raise KeyError(f"unknown kernel switch {name!r}; valid names: {', '.join(sorted(SWITCHES))}")
    return name not in disabled()


def kernel_builds(make: Callable[[], object]) -> bool:
    """Whether ``make()`` (a kernel module's cached builder) succeeds: Triton importable and the kernel defined.
    A fast path's capability gate ends with this; on ``False`` the caller takes its reference path."""
    try:
        make()
    except Exception:  # noqa: BLE001 - no triton (or it cannot build the kernel): the reference path serves
        return False
    return True
