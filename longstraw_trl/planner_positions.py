"""Does the model take P + R positions at all? ``max_position_embeddings`` and the RoPE scaling against a prompt
plus its response (:func:`check_positions`), with what to change when they do not."""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass, field

from .model_patches.base import CALL_DEPENDENT_ROPE


def _rope_entries(config) -> list[tuple[str | None, dict]]:
    """``(layer type or None, RoPE parameters)`` of each RoPE the config declares: transformers 5's
    ``rope_parameters`` (flat, or one dict per layer type), else a transformers 4 ``rope_scaling`` + ``rope_theta``."""
    rope = getattr(config, "rope_parameters", None)
    if not rope:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
        if theta is not None:
            scaling.setdefault("rope_theta", theta)
        rope = scaling
    if not rope:
        return []
    if hasattr(config, "nested_rope_parameter_keys"):
        nested = config.nested_rope_parameter_keys(rope)
    else:
        nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        return [(key, dict(rope[key])) for key in nested if rope[key] is not None]
    return [(None, dict(rope))]


@dataclass
class PositionCheck:
    """Whether the model takes ``needed`` = P + R positions (see :func:`check_positions`).

    Args:
        needed: prompt plus completion tokens, the positions one response's last token sits at.
        max_position_embeddings: the config's; the engine refuses more (``PromptTooLongError``).
        rope: one line per RoPE the config declares (per layer type in transformers 5), with its reach.
        limit: the most positions the model takes: the smaller of ``max_position_embeddings`` and the reach
            of a YaRN scaling (``factor`` x ``original_max_position_embeddings``); None when nothing bounds it.
        problems: what stops P + R, each with what to change; empty when it runs.
    """

    needed: int
    max_position_embeddings: int | None
    rope: list[str]
    limit: int | None
    #: what sets ``limit``: ``"max_position_embeddings"``, ``"the YaRN scaling"``, or None
    limited_by: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def check_positions(config, prompt_tokens: int, response_tokens: int) -> PositionCheck:
    """Check P + R against what the config's positions allow, and say what to change when they do not.

    Two limits: the engine refuses a prompt + completion beyond ``max_position_embeddings``
    (``engine.check_max_position_embeddings``), and a YaRN scaling extends RoPE to ``factor`` x
    ``original_max_position_embeddings`` (transformers' ``_compute_yarn_parameters``; without ``factor``:
    ``max_position_embeddings`` / ``original_max_position_embeddings``), past which the model attends at positions
    its scaling was not made for. Without scaling (``default``), ``max_position_embeddings`` is taken as the trained
    length. Linear and llama3 scaling do not say how far they reach: only ``max_position_embeddings`` bounds them.
    ``dynamic`` and ``longrope`` (frequencies that depend on each call's length) are refused by the engine at any
    length. Sliding-window layers' RoPE is not checked: their queries see keys at most ``sliding_window`` back.
    """
    needed = prompt_tokens + response_tokens
    mpe = getattr(config, "max_position_embeddings", None)
    window = getattr(config, "sliding_window", None)
    lines: list[str] = []
    problems: list[str] = []
    reaches: list[tuple[int, str, int]] = []  # (reach, description, original) of each YaRN
    unscaled = False
    for layer_type, params in _rope_entries(config):
        rtype = params.get("rope_type") or params.get("type") or "default"
        where = f"{layer_type}: " if layer_type else ""
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        desc = f"{where}rope_type={rtype!r}"
        if factor is not None:
            desc += f", factor={factor:g}"
        if original is not None:
            desc += f", original_max_position_embeddings={original:,}"
        if layer_type == "sliding_attention" and window:
            lines.append(f"{desc} (sliding window {window:,}: not a limit)")
            continue
        if rtype in CALL_DEPENDENT_ROPE:
            lines.append(desc)
            problems.append(
                f"{where}rope_type={rtype!r} is refused by LongStraw at any length (its frequencies depend on each "
                "call's length, which a chunked capture cannot reproduce): use 'yarn' with a factor and "
                "original_max_position_embeddings instead"
            )
            continue
        if rtype == "yarn":
            original = original or mpe
            if factor is None and mpe and original:
                factor = mpe / original
            if factor and original:
                reach = int(factor * original)
                reaches.append((reach, desc, original))
                desc += f" -> reaches {reach:,} positions"
        elif rtype == "default":
            unscaled = True
            desc += " (no scaling)"
        lines.append(desc)
    limit, limited_by = mpe, "max_position_embeddings" if mpe is not None else None
    for reach, _, _ in reaches:
        if limit is None or reach < limit:
            limit, limited_by = reach, "the YaRN scaling"
    raise_mpe = f"set max_position_embeddings >= {needed:,} in config.json"
    shorter = (
        f"or plan a shorter --prompt (at most {limit - response_tokens:,} with --response {response_tokens:,})"
        if limit is not None and limit > response_tokens
        else "or shorten the prompt and the response"
    )
    short_yarn = [(r, d, o) for r, d, o in reaches if r < needed]
    if short_yarn:
        for reach, desc, original in short_yarn:
            problems.append(
                f"the YaRN scaling ({desc.split(' -> ')[0]}) reaches {reach:,} positions < P + R = {needed:,}: set its "
                f"factor to {math.ceil(needed / original)}.0 or more ({needed:,} / {original:,} = {needed / original:.2f}) and "
                f"{raise_mpe} (a factor the model was not tuned with may cost quality), {shorter}"
            )
    elif mpe is not None and needed > mpe:
        if reaches:
            what = (
                f"the RoPE scaling reaches {min(r for r, _, _ in reaches):,}: {raise_mpe}, "
                "as LongStraw's engine refuses positions past it"
            )
        elif unscaled:
            what = (
                f"without RoPE scaling the model knows {mpe:,} positions: add a YaRN scaling, rope_parameters "
                f'{{"rope_type": "yarn", "factor": {math.ceil(needed / mpe)}.0, '
                f'"original_max_position_embeddings": {mpe}}} (rope_scaling in a transformers 4 config), and '
                f"{raise_mpe} (a factor the model was not tuned with may cost quality)"
            )
        else:
            what = f"{raise_mpe} with a RoPE scaling that reaches that far (e.g. yarn)"
        problems.append(
            f"P + R = {needed:,} > max_position_embeddings = {mpe:,}: LongStraw refuses it "
            f"(PromptTooLongError); {what}, {shorter}"
        )
    return PositionCheck(needed, mpe, lines, limit, limited_by, problems)


def format_positions(check: PositionCheck) -> str:
    """The positions section of ``longstraw plan``'s text."""
    limit = f"{check.limit:,} ({check.limited_by})" if check.limit is not None else "no limit in the config"
    verdict = "OK" if check.ok else "DOES NOT RUN"
    lines = [
        f"positions           P + R = {check.needed:,}, the model takes {limit}  ->  {verdict}",
        f"  max_position_embeddings {check.max_position_embeddings:,}"
        if check.max_position_embeddings is not None
        else "  max_position_embeddings not set",
    ]
    lines += [f"  RoPE {r}" for r in check.rope] or ["  no RoPE parameters in the config"]
    for p in check.problems:
        lines += textwrap.wrap(p, 110, initial_indent="problem: ", subsequent_indent="  ")
    return "\n".join(lines)
