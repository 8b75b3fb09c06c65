"""Prefix sharing: the decision points of one long trajectory, captured once and extended, against capturing each whole.

An agent's trajectory of ``--trajectory`` tokens has ``--points`` decision points, one every ``--turn`` tokens at its
end. The prompt of a decision point is the history so far plus its rendered question (``--tail`` tokens that the
next turn's history does not contain: the last turn renders differently once it is history), so no prompt is a
token prefix of another. Three ways to build their prompt states, all through the trainer's own code
(``PromptStateCache``, ``branch_prefixes``; policy captures keep the chunk boundaries, as with
``prompt_prefix_sharing=True``):

- ``batch``: the points are one generation batch: the prompt trie's trunk is captured once and every point
  extends it (``PromptStateManager.acquire_groups``);
- ``steps``: one point per step: each branches off the previous point's cached state at the last chunk boundary
  before their common prefix ends (GDN states cannot be rewound), re-prefilling at most one chunk beyond its own
  new tokens;
- ``whole``: each prompt captured from its first token (``--whole-points`` of them: a 512K capture takes ~9 s on
  the 4-layer slice, the others would cost the same).

Reports per decision point the tokens prefilled and the seconds, and checks the log-probs of a few response tokens
on the shared states against the whole captures (bf16). Qwen3.6-27B slice (real widths, ``--layers``, default 4:
3 GDN + 1 attention), random bf16 weights.

    python bench/prefix_tree.py --trajectory 524288 --points 8
    python bench/prefix_tree.py --smoke     # CPU dry run, tiny widths
"""

from __future__ import annotations

import argparse

import torch
from common import GiB, Timer, peak_gib, print_table, reset_peak, write_result
from engine_slice import slice_config
from transformers import AutoModelForCausalLM

from longstraw_trl import capture_prompt, extend_state, replay_logprobs
from longstraw_trl.refresh import RefreshPolicy
from longstraw_trl.state_cache import PromptStateCache, branch_prefixes, prompt_key


class Recorder:
    """The cache's capture / extend, recording the tokens each prefills and its seconds."""

    def __init__(self, model, chunk: int, page: int):
        self.model, self.chunk, self.page = model, chunk, page
        self.calls: list[tuple[str, int, float]] = []

    def capture(self, ids: torch.Tensor):
        with Timer() as t:
            state = capture_prompt(
                self.model, ids, chunk_size=self.chunk, page_size=self.page, keep_boundaries=True
            )
        self.calls.append(("capture", ids.numel(), t.seconds))
        return state

    def extend(self, state, more: torch.Tensor):
        with Timer() as t:
            new = extend_state(state, self.model, more)
        self.calls.append(("extend", more.numel(), t.seconds))
        return new

    def cache(self, steps: int) -> PromptStateCache:
        """A cache whose states stay usable for ``steps`` steps (``reuse``: an extension inherits its source's age)."""
        return PromptStateCache(
            self.capture,
            self.extend,
            RefreshPolicy("reuse", steps),
            max_bytes=None,
            prompt_prefix_sharing=True,
        )

    def since(self, start: int) -> tuple[int, float]:
        calls = self.calls[start:]
        return sum(n for _, n, _ in calls), sum(s for _, _, s in calls)


def decision_points(
    trajectory: torch.Tensor, points: int, turn: int, tail: torch.Tensor
) -> list[torch.Tensor]:
    """Point k: the history up to ``len - (points - 1 - k) * turn`` tokens, then the rendered question ``tail``."""
    cuts = [trajectory.numel() - (points - 1 - k) * turn for k in range(points)]
    return [torch.cat([trajectory[:c], tail]) for c in cuts]


def main() -> None:  # noqa: C901 - one benchmark, three modes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trajectory", type=int, default=524288)
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--turn", type=int, default=2048, help="tokens between two decision points")
    ap.add_argument("--tail", type=int, default=24, help="tokens of a decision point's rendered question")
    ap.add_argument(
        "--whole-points", type=int, default=2, help="decision points also captured whole (baseline)"
    )
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--response", type=int, default=16, help="response tokens scored for the log-prob check")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run with tiny widths")
    args = ap.parse_args()
    if args.smoke:
        args.trajectory, args.turn, args.chunk, args.page = min(args.trajectory, 96), 16, 32, 32
        args.points, args.tail, args.response, args.whole_points = min(args.points, 3), 8, 4, 1
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    config = slice_config(
        args.preset, args.layers, args.trajectory + args.tail + args.response + 16, tiny=args.smoke
    )
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    trajectory = torch.randint(0, config.vocab_size, (args.trajectory,), generator=gen)
    tail = torch.randint(0, config.vocab_size, (args.tail,), generator=gen)
    prompts = decision_points(trajectory, args.points, args.turn, tail)
    response = torch.randint(0, config.vocab_size, (1, args.response), generator=gen).to(dev)
    recorder = Recorder(model, args.chunk, args.page)
    rows, states = [], {}

    with torch.no_grad():
        # batch: the trie's trunks once, then every point (what PromptStateManager.acquire_groups does)
        reset_peak()
        cache = recorder.cache(args.points)
        start = len(recorder.calls)
        trunks = branch_prefixes(prompts, min_tokens=2)
        for trunk in trunks:
            cache.get(trunk, step=0)
        trunk_tokens, trunk_s = recorder.since(start)
        rows.append(
            {"mode": "batch", "point": "trunk", "prefilled": trunk_tokens, "seconds": round(trunk_s, 3)}
        )
        for k, ids in enumerate(prompts):
            start = len(recorder.calls)
            entry = cache.get(ids, step=0).entry
            n, s = recorder.since(start)
            rows.append({"mode": "batch", "point": k, "prefilled": n, "seconds": round(s, 3)})
            states[("batch", k)] = entry.state
        batch_peak, batch_gib = peak_gib(), cache.nbytes() / GiB
        del cache

        # steps: one point a step, each branching off the previous point's cached state
        reset_peak()
        cache = recorder.cache(args.points)
        for k, ids in enumerate(prompts):
            start = len(recorder.calls)
            lookup = cache.get(ids, step=k)
            n, s = recorder.since(start)
            rows.append({"mode": "steps", "point": k, "prefilled": n, "seconds": round(s, 3)})
            assert k == 0 or lookup.action == "extend", lookup.action
            states[("steps", k)] = lookup.entry.state
            for key in [key for key in cache.entries if key != prompt_key(ids)]:  # keep the last point only
                cache.drop([key])
        steps_peak = peak_gib()
        del cache

        # whole: the baseline, and the log-probs the shared states must give
        whole_points = sorted({args.points - 1 - i for i in range(min(args.whole_points, args.points))})
        max_diff = 0.0
        for k in whole_points:
            state = recorder.capture(prompts[k])
            _, n, s = recorder.calls[-1]
            rows.append({"mode": "whole", "point": k, "prefilled": n, "seconds": round(s, 3)})
            ref = replay_logprobs(state, model, response).float()
            for mode in ("batch", "steps"):
                got = replay_logprobs(states[(mode, k)], model, response).float()
                max_diff = max(max_diff, (got - ref).abs().max().item())
            del state

    def total(mode: str) -> tuple[int, float]:
        picked = [r for r in rows if r["mode"] == mode]
        return sum(r["prefilled"] for r in picked), sum(r["seconds"] for r in picked)

    whole_rows = [r for r in rows if r["mode"] == "whole"]
    per_whole_s = sum(r["seconds"] for r in whole_rows) / len(whole_rows)
    summary = []
    for mode in ("batch", "steps"):
        n, s = total(mode)
        summary.append(
            {
                "mode": mode,
                "points": args.points,
                "prefilled": n,
                "seconds": round(s, 2),
                "whole_prefilled": sum(p.numel() for p in prompts),
                "whole_seconds_est": round(per_whole_s * args.points, 2),
                "speedup_est": round(per_whole_s * args.points / max(s, 1e-9), 1),
            }
        )
    print_table(rows)
    print()
    print(f"log-probs of the shared states against whole captures (bf16): max abs diff {max_diff:.3g}")
    print(f"peak: batch {batch_peak:.1f} GiB (states held {batch_gib:.2f} GiB), steps {steps_peak:.1f} GiB")
    print(
        f"whole capture measured on points {whole_points}: {per_whole_s:.2f} s each; 'est' = x {args.points}"
    )
    print_table(summary)
    write_result(
        f"prefix_tree_{args.preset}_{args.layers}L" + ("_smoke" if args.smoke else ""),
        {
            "preset": args.preset,
            "layers": args.layers,
            "trajectory_tokens": args.trajectory,
            "points": args.points,
            "turn_tokens": args.turn,
            "tail_tokens": args.tail,
            "chunk": args.chunk,
            "trunks": [int(t.numel()) for t in trunks],
            "rows": rows,
            "summary": summary,
            "whole_points_measured": whole_points,
            "max_abs_logprob_diff_vs_whole": max_diff,
            "peak_gib": {"batch": batch_peak, "steps": steps_peak},
            "batch_state_gib": batch_gib,
            "description": "decision points of one trajectory whose rendered prompts are not prefixes of each "
            "other: the batch trie's trunk captured once then extended (batch), each point branching off the "
            "previous one's cached state at a chunk boundary (steps), and captures of whole prompts (whole)",
        },
    )


if __name__ == "__main__":
    main()
