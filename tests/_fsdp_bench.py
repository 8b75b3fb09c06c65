"""Run a bench script under ``accelerate launch`` with FSDP2 on the CPU (``_fsdp_shim.fsdp_on_cpu``), as the device
runs it on GPUs: ``accelerate launch --config_file examples/accelerate/fsdp2.yaml tests/_fsdp_bench.py
bench/full_model.py --tiny ...``."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _fsdp_shim import fsdp_on_cpu  # noqa: E402

if __name__ == "__main__":
    if not fsdp_on_cpu():
        sys.exit("_fsdp_bench.py: run it under an FSDP launch (ACCELERATE_USE_FSDP=true) without a GPU")
    script = Path(sys.argv[1]).resolve()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
