"""The ``real-long`` suite on a CPU at a few hundred tokens: the long-facts task (examples/_long_facts.py) and the
suite's plumbing (bench/real_long.py) with a tiny random Gemma-3 and the toy tokenizer: the three objectives run a step
each, the records have their fields, a run stopped mid-way resumes from its checkpoint, the runner builds the call."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "examples")]

import _long_facts as task  # noqa: E402

from longstraw_trl.toy_tokenizer import build_toy_tokenizer  # noqa: E402

TINY = ["--model", "tiny-gemma3", "--device", "cpu", "--threads", "1", "--prompt", "300", "--seeds", "0"]
SMALL = ["--num-generations", "2", "--questions-per-step", "1", "--questions-per-doc", "2", "--completion-tokens", "4",
         "--eval-docs", "1", "--eval-questions", "2", "--cosine-lengths", "300", "--cosine-groups", "1",
         "--cosine-tries", "1", "--stock-rows-per-forward", "1", "--stock-prefill-chunk", "64"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer(128)


def test_documents_state_the_answers_within_the_length(tokenizer):
    spec = task.TaskSpec(doc_tokens=600, questions_per_doc=4)
    rows = task.make_split(tokenizer, 3, spec, seed=1000)
    held_out = task.make_split(tokenizer, 3, spec, seed=task.HELD_OUT_SEED)
    assert len(rows) == 12 and {r["doc_id"] for r in rows} == {0, 1, 2}
    assert not {r["doc"] for r in rows} & {r["doc"] for r in held_out}
    for row in rows:
        assert 500 < len(task.document_ids(tokenizer, row["doc"])) <= 600
        attribute, person = row["question"].split("What is the ")[1].split("?")[0].split(" of ")
        assert f"The {attribute} of {person} is {row['answer']}." in row["doc"]
        task.check_prefix(tokenizer, row)
    assert task.exact_reward([" 1234.", " 1234 and", "1243.", ""], ["1234"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_each_person_has_a_distractor_fact(tokenizer):
    doc, table = task.make_document(tokenizer, random.Random(0), task.TaskSpec(doc_tokens=2000))
    people = [p for _, p in table]
    assert (
        max(people.count(p) for p in people) == 2
    )  # two attributes of one person: one is the other's distractor
    assert len(table) == len(re.findall(r" is \d{4}\.", doc))  # only the facts the document states


def _main(tmp_path: Path, *args: str) -> None:
    import real_long

    assert real_long.main([*TINY, *SMALL, "--state-dir", str(tmp_path / "state"), *args]) == 0


def test_three_objectives_one_step_each_and_the_records(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    _main(tmp_path, "--steps", "1")
    data = json.loads((tmp_path / "out" / "real_long_tiny-gemma3_cpu_P300.json").read_text())
    assert data["command"] and data["git_revision"] and data["date"] and data["device"].startswith("cpu")
    assert data["complete"] and [r["arm"] for r in data["runs"]] == ["stock", "full", "response_only"]
    (check,) = data["check"]
    assert check["within_bound"] and check["bound"] == 1e-4 and check["prompt_tokens"] >= 250
    assert data["heldout_before"]["questions"] == 2
    for run in data["runs"]:
        assert run["steps_done"] == 1 and len(run["reward_curve"]) == 1 and len(run["step_phases"]) == 1
        assert {"step", "generate_and_score", "loss_and_backward", "optimizer"} <= set(run["step_phases"][0])
        assert run["heldout_after"]["questions"] == 2 and "accuracy_stderr" in run["heldout_after"]
        assert run["peak_memory_gib"] > 0 and run["lora"].startswith("r=16")
    assert "document_capture" in data["runs"][2]["step_phases"][0]  # LongStraw: the document captured once
    # stock: one row a forward, accumulated to the step's two rows; LongStraw: the step's rows at once
    assert [(r["rows_per_forward"], r["gradient_accumulation_steps"]) for r in data["runs"]] == [
        (1, 2),
        (2, 1),
        (2, 1),
    ]
    assert [s["arm"] for s in data["summary"]] == ["stock", "full", "response_only"]
    cosine = json.loads((tmp_path / "out" / "real_cosine_tiny-gemma3_cpu_P300-300.json").read_text())
    (row,) = cosine["rows"]
    assert row["full_vs_stock"]["cosine"] > 0.9999  # the full gradient is stock's
    assert set(row["response_only_vs_full"]["modules"]) == {"q", "k", "v", "o", "mlp"}
    assert cosine["table"][0]["groups"] == 1


def test_a_stopped_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    resume = ["--arms", "response_only", "--steps", "2", "--max-steps-per-call", "1", "--parts", "train"]
    _main(tmp_path, *resume)
    run_dir = tmp_path / "state" / "runs" / "response_only_seed0"
    assert (run_dir / "checkpoint-1").is_dir() and not (
        tmp_path / "state" / "runs" / "response_only_seed0.json"
    ).exists()
    first = json.loads((run_dir / "clock.json").read_text())["steps"]
    _main(tmp_path, *resume)
    record = json.loads((tmp_path / "state" / "runs" / "response_only_seed0.json").read_text())
    assert record["steps_done"] == 2 and len(record["reward_curve"]) == 2
    assert (
        record["step_phases"][0] == first[0]
    )  # the first call's step, kept; the second call ran step 2 only
    assert not list(run_dir.glob("checkpoint-*"))  # a finished run drops its checkpoints


def test_another_machine_resumes_from_the_result_file(tmp_path, monkeypatch):
    """`--resume-from`: a fresh state takes the finished runs, the check and the evaluation before training of a
    result file of the same settings, runs only what is missing, and writes them all; other settings are refused."""
    import real_long

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    first = ["--arms", "response_only", "--steps", "1", "--parts", "check", "train"]
    _main(tmp_path, *first)
    result = tmp_path / "out" / "real_long_tiny-gemma3_cpu_P300.json"
    kept = json.loads(result.read_text())["runs"][0]
    fresh = [
        *TINY,
        *SMALL,
        "--steps",
        "1",
        "--parts",
        "check",
        "train",
        "--state-dir",
        str(tmp_path / "fresh"),
    ]
    assert real_long.main([*fresh, "--arms", "stock", "response_only", "--resume-from", str(result)]) == 0
    data = json.loads(result.read_text())
    assert [r["arm"] for r in data["runs"]] == ["stock", "response_only"] and data["complete"]
    assert data["runs"][1] == kept  # taken as it was, not run again
    other = [
        *TINY,
        *SMALL,
        "--steps",
        "2",
        "--state-dir",
        str(tmp_path / "other"),
        "--resume-from",
        str(result),
    ]
    with pytest.raises(SystemExit, match="other settings"):
        real_long.main(other)


def test_the_runner_builds_the_call():
    out = subprocess.run(
        [sys.executable, "bench/run.py", "real-long", "--dry-run", "--prompt", "32000", "--seeds", "0"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "real_long.py --prompt 32000 --budget-s 515 --state-dir /tmp/longstraw_real_long" in out
    assert out.rstrip().endswith("--seeds 0)") and "--cache-dir /tmp/longstraw_cache" in out
