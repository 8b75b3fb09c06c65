"""Memory planner: will a LongStraw run fit, and where do the bytes go (per rank)? (``longstraw plan``)

The planner's public names, from the modules that own them: what it plans (:mod:`.planner_inputs`), the plan and
its driver over the step's parts (:mod:`.planner_memory`), the terms from the model config (:mod:`.planner_terms`;
each family's layer formulas are its patch's, ``FamilyPatch.planned_*`` beside ``LayerState.planned_bytes``), the
changes that make a plan fit (:mod:`.planner_suggestions`), the printed plan (:mod:`.planner_report`), and whether the
model takes the positions (:mod:`.planner_positions`).
"""

from __future__ import annotations

from .planner_inputs import (
    DEFAULT_HOST_MEMORY_GIB,
    DEFAULT_RANKS_PER_HOST,
    GPU_MEMORY_GIB,
    SHORT_NAMES,
    GiB,
    PlanInputs,
)
from .planner_memory import PLANNER_ONLY_MODEL_TYPES, MemoryPlan, check_plannable, largest_prompt, plan_memory
from .planner_positions import CALL_DEPENDENT_ROPE, PositionCheck, check_positions, format_positions
from .planner_report import format_plan, format_suggestions
from .planner_suggestions import SMALLEST_SUGGESTED_CHUNK, SUGGESTED_LORA_RANK, Suggestion, suggest_changes
from .planner_terms import (
    count_parameters,
    fsdp_groups,
    fsdp_shard_elements,
    full_gradient_bytes,
    kept_page_parts_bytes,
    lora_parameters,
    offload_bytes,
    planned_layer_types,
    shared_prefix_boundary_bytes,
    state_bytes,
)

__all__ = [
    "CALL_DEPENDENT_ROPE",
    "DEFAULT_HOST_MEMORY_GIB",
    "DEFAULT_RANKS_PER_HOST",
    "GPU_MEMORY_GIB",
    "PLANNER_ONLY_MODEL_TYPES",
    "SHORT_NAMES",
    "SMALLEST_SUGGESTED_CHUNK",
    "SUGGESTED_LORA_RANK",
    "GiB",
    "MemoryPlan",
    "PlanInputs",
    "PositionCheck",
    "Suggestion",
    "check_plannable",
    "check_positions",
    "count_parameters",
    "format_plan",
    "format_positions",
    "format_suggestions",
    "fsdp_groups",
    "fsdp_shard_elements",
    "full_gradient_bytes",
    "kept_page_parts_bytes",
    "largest_prompt",
    "lora_parameters",
    "offload_bytes",
    "plan_memory",
    "planned_layer_types",
    "shared_prefix_boundary_bytes",
    "state_bytes",
    "suggest_changes",
]
