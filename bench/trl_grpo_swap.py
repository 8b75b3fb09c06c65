"""pytest plugin (`-p trl_grpo_swap`) for bench/trl_grpo_tests.py: with `LONGSTRAW_SWAP=1`, TRL's GRPO test file sees
`LongStrawGRPOTrainer` / `LongStrawGRPOConfig` under the names it imports (`from trl import GRPOConfig, GRPOTrainer`).

The swap is made on `trl`'s module attributes before collection imports the test module, and again on every collected
module that bound the names, so `patch.object(GRPOTrainer, ...)` in a test patches our class. Without the variable
the plugin only adds the
shim below, so both runs load the same code.
"""

from __future__ import annotations

import os


def pytest_configure(config):
    import importlib
    import importlib.util

    import_utils = importlib.import_module("trl.import_utils")
    # TRL's newest stored tests/testing_utils.py imports a helper TRL 1.16 lacks: the same shim on both sides
    if not hasattr(import_utils, "is_joblib_available"):
        import_utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None
    if os.environ.get("LONGSTRAW_SWAP") != "1":
        return
    import trl

    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    trl.GRPOTrainer = LongStrawGRPOTrainer
    trl.GRPOConfig = LongStrawGRPOConfig


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("LONGSTRAW_SWAP") != "1":
        return
    from longstraw_trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if hasattr(module, "GRPOTrainer"):
            module.GRPOTrainer = LongStrawGRPOTrainer
        if hasattr(module, "GRPOConfig"):
            module.GRPOConfig = LongStrawGRPOConfig


def pytest_sessionstart(session):
    # fp32 on both sides unless LONGSTRAW_TRL_BF16=1: TRL's bf16=True default is CPU autocast here, ~4.5x slower per
    # step on this CPU (its bf16 matmuls), which would put the two runs far past their time budget
    if os.environ.get("LONGSTRAW_TRL_BF16") == "1":
        return
    from trl.trainer.base_config import _BaseConfig

    original = _BaseConfig.__post_init__

    def fp32_post_init(self):
        self.bf16 = False
        original(self)

    _BaseConfig.__post_init__ = fp32_post_init


def pytest_runtest_logreport(report):
    """One JSON line per test as it finishes (`LONGSTRAW_RESULTS`), so a run cut at its deadline still reports."""
    path = os.environ.get("LONGSTRAW_RESULTS")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller writes each report once
        return
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    import json

    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    else:
        outcome = "error" if report.failed and report.when != "call" else report.outcome
    message = ""
    if report.failed or report.skipped:
        text = report.longreprtext.strip().splitlines()
        errors = [line for line in text if line.startswith("E ")]
        message = (errors[0][1:].strip() if errors else (text[-1] if text else ""))[:300]
    test_id = report.nodeid.split("::", 1)[-1]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test_id, "outcome": outcome, "time_s": round(report.duration, 2),
                            "message": message, "run": int(os.environ.get("LONGSTRAW_RUN_INDEX", "0"))}) + "\n")  # fmt: skip
