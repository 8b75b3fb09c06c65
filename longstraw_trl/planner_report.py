"""The text ``longstraw plan`` prints: a plan's terms and peaks (:func:`format_plan`), and the changes that make one
fit (:func:`format_suggestions`)."""

from __future__ import annotations

from .planner_inputs import GiB
from .planner_memory import MemoryPlan
from .planner_suggestions import SMALLEST_SUGGESTED_CHUNK, SUGGESTED_LORA_RANK, Suggestion


def format_suggestions(suggestions: list[Suggestion], gpu_bytes: int) -> str:
    """The text ``longstraw plan`` prints under a plan that does not fit."""
    if not suggestions:
        return (
            f"nothing tried fits {gpu_bytes / GiB:.2f} GiB: --checkpoint-layers, --lora-rank {SUGGESTED_LORA_RANK}, "
            f"--ep (MoE), --offload cpu (within --host-memory), a --chunk-size down to {SMALLEST_SUGGESTED_CHUNK}, "
            "a larger --cp and a smaller --prompt, alone or together"
        )
    width = max(len(" ".join(s.args)) for s in suggestions)
    lines = [f"to fit {gpu_bytes / GiB:.2f} GiB, change any one of (each re-planned):"]
    for s in suggestions:
        host = ""
        if s.host_bytes and s.host_pinned_bytes == s.host_bytes:
            host = f" (+ {s.host_bytes / GiB:.2f} GiB of pinned host memory a rank)"
        elif s.host_bytes:
            host = (
                f" (+ {s.host_bytes / GiB:.2f} GiB of host memory a rank, {s.host_pinned_bytes / GiB:.2f} GiB of "
                "it pinned)"
            )
        lines.append(f"  {' '.join(s.args):<{width}}  ->  peak {s.peak / GiB:.2f} GiB{host}")
    return "\n".join(lines)


def format_plan(plan: MemoryPlan) -> str:
    """The text ``longstraw plan`` prints for a plan: its terms, peaks and notes."""

    def g(x: int) -> str:
        return f"{x / GiB:10.2f} GiB"

    lines = [
        f"parameters {plan.params / 1e9:.2f} B on this rank, trainable {plan.trainable_params / 1e9:.3f} B",
        f"  weights           {g(plan.weights)}",
        f"  gradients         {g(plan.gradients)}",
        f"  optimizer         {g(plan.optimizer)}",
    ]
    if plan.fsdp_gathered:
        lines += [
            f"  FSDP2 gathered    {g(plan.fsdp_gathered)}  (root + two decoder layers, unsharded; the capture holds "
            f"the two layers, {g(plan.fsdp_gathered_in_capture).strip()})",
            f"  unsharded grads   {g(plan.fsdp_unsharded_gradients)}  (accumulated under no_sync until the step's last backward)",
        ]
    for kind, n in plan.state_by_kind.items():
        lines.append(f"  state[{kind}]{' ' * (11 - len(kind))}{g(n)}")
    if plan.host_state:
        lines += [
            f"  of it on the host {g(plan.host_state)}  (pinned; not in the GPU peaks)",
            f"  streamed back     {g(plan.offload_workspace)}  (the running layer's)",
        ]
    lines += [
        f"  response graph    {g(plan.response_graph)}",
        f"  logits/head temp  {g(plan.logits)}",
        f"  capture chunk     {g(plan.capture_workspace)}",
    ]
    if plan.gradient_buffers or plan.kept_boundaries:
        lines += [
            f"  full-grad buffers {g(plan.gradient_buffers)}"
            + (
                f"  (of it on the host {g(plan.host_gradient_buffers)})" if plan.host_gradient_buffers else ""
            ),
            f"  kept boundaries   {g(plan.kept_boundaries)}"
            + (f"  (of it on the host {g(plan.host_kept_boundaries)})" if plan.host_kept_boundaries else ""),
            f"  page dK/dV temp   {g(plan.page_grad_workspace)}",
            f"  prompt bwd graph  {g(plan.prompt_backward_graph)}",
            f"  kept page parts   {g(plan.prompt_backward_page_parts)}",
        ]
    lines += [
        f"capture peak        {g(plan.capture_peak)}",
        f"replay peak         {g(plan.replay_peak)}",
        *([f"prompt bwd peak     {g(plan.prompt_backward_peak)}"] if plan.prompt_backward_graph else []),
        f"GPU memory          {g(plan.gpu_bytes)}  ->  {'FITS' if plan.fits_gpu else 'DOES NOT FIT'}",
    ]
    if plan.host_bytes:
        lines.append(
            f"host memory         {g(plan.host_memory)}  ->  {'FITS' if plan.fits_host else 'DOES NOT FIT'}"
            + (
                "  (pinned, this rank's share)"
                if plan.host_pinned_bytes == plan.host_bytes
                else f"  (this rank's share; {g(plan.host_pinned_bytes).strip()} of the {g(plan.host_bytes).strip()} "
                "pinned: the dK/dV buffers are pageable)"
            )
        )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
