"""`examples/grpo_lockers.py` (`make demo`) at tiny sizes on SmolLM2-135M-Instruct: a training step and the held-out
evaluations run, each question extends its document's captured state, and the run's files are written."""

from __future__ import annotations

import json

from _examples import load_example

TINY = ["--facts", "4", "--questions-per-doc", "2", "--eval-docs", "1", "--eval-questions", "1", "--steps", "1",
        "--num-generations", "2", "--questions-per-step", "1", "--completion-tokens", "2", "--lora-rank", "2"]  # fmt: skip


def test_one_step_on_the_pretrained_model(tmp_path):
    out = tmp_path / "lockers"
    summary = load_example("grpo_lockers").main([*TINY, "--output-dir", str(out)])
    assert len(summary["reward_curve"]) == 1
    # the step's question extends its document's state: the document's tokens are reused, not prefilled again
    assert summary["train_prompt_tokens_reused"] == summary["document_tokens"]
    assert summary["heldout_after"]["questions"] == 1
    assert summary["heldout_after"]["prompt_tokens_reused"] > 0
    assert summary["seconds_per_step"] > 0 and summary["peak_memory_gib"] > 0
    assert json.loads((out / "summary.json").read_text())["document_tokens"] == summary["document_tokens"]
    assert (out / "log_history.json").is_file() and (out / "adapter_config.json").is_file()
