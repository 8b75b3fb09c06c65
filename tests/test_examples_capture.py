"""`examples/capture_replay.py` at tiny sizes: the replayed log-probs equal the stock forward's, and every response's
backward reaches the weights."""

from __future__ import annotations

import math

from _examples import load_example


def test_capture_replay_matches_the_stock_forward(capsys):
    summary = load_example("capture_replay").main(
        [
            "--prompt-tokens",
            "40",
            "--response-tokens",
            "4",
            "--num-generations",
            "2",
            "--chunk-size",
            "16",
            "--page-size",
            "32",
        ]  # fmt: skip
    )
    assert summary["prompt_tokens"] == 40 and summary["completions"] == 2
    assert summary["max_abs_logprob_difference"] <= 1e-4
    assert math.isfinite(summary["grad_norm"]) and summary["grad_norm"] > 0
    assert "max |replay - stock full forward|" in capsys.readouterr().out
