"""The package's layers (docs/design.md, "Architecture"), checked on the source: imports go one way, down the layers;
no first-party import hides inside a function; no private name crosses a module; agents and tests use the
trainer's public surface only; the TRL hooks the trainer overrides keep the signatures it was written against."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "longstraw_trl": "longstraw_trl",
    "model_patches": "longstraw_trl.model_patches",
    "kernels": "longstraw_trl.kernels",
}

# Each module's layer; a module imports only from its own layer or below (and never in a cycle).
BOTTOM, STATE, RUNTIME, STEP, GLUE = range(5)
LAYER_NAMES = ["bottom", "state", "runtime", "grpo step", "trl glue"]
LAYERS = {
    "longstraw_trl.errors": BOTTOM,
    "longstraw_trl.constants": BOTTOM,
    "longstraw_trl.config": BOTTOM,  # plain data: imports nothing of the runtime
    "longstraw_trl.options": BOTTOM,
    "longstraw_trl.parallel_dims": BOTTOM,
    "longstraw_trl.context_parallel": BOTTOM,
    "longstraw_trl.fsdp": BOTTOM,
    "longstraw_trl.expert_parallel": BOTTOM,
    "longstraw_trl.kernels": BOTTOM,
    "longstraw_trl.toy_tokenizer": BOTTOM,
    "longstraw_trl.qwen_tokenizer": BOTTOM,
    "longstraw_trl.pretrained": BOTTOM,
    "longstraw_trl.host_memory": STATE,
    "longstraw_trl.layer_state": STATE,
    "longstraw_trl.prompt_state": STATE,
    "longstraw_trl.state_grads": STATE,
    "longstraw_trl.refresh": STATE,
    "longstraw_trl.context": RUNTIME,
    "longstraw_trl.hooks": RUNTIME,
    "longstraw_trl.model_patches": RUNTIME,
    "longstraw_trl.engine": RUNTIME,
    "longstraw_trl.generation": RUNTIME,
    "longstraw_trl.adapters": RUNTIME,
    "longstraw_trl.fused_forwards": RUNTIME,
    "longstraw_trl.router_aux": RUNTIME,
    "longstraw_trl.planner": RUNTIME,
    "longstraw_trl.planner_inputs": RUNTIME,
    "longstraw_trl.planner_memory": RUNTIME,
    "longstraw_trl.planner_positions": RUNTIME,
    "longstraw_trl.planner_report": RUNTIME,
    "longstraw_trl.planner_suggestions": RUNTIME,
    "longstraw_trl.planner_terms": RUNTIME,
    "longstraw_trl.presets": RUNTIME,
    "longstraw_trl.cli": RUNTIME,
    "longstraw_trl.cli_plan": RUNTIME,
    "longstraw_trl.positions": RUNTIME,
    "longstraw_trl.preflight": RUNTIME,
    "longstraw_trl.state_cache": STEP,
    "longstraw_trl.loss": STEP,
    "longstraw_trl.loss_spec": STEP,
    "longstraw_trl.loss_metrics": STEP,
    "longstraw_trl.loss_rows": STEP,
    "longstraw_trl.loss_sync": STEP,
    "longstraw_trl.loss_terms": STEP,
    "longstraw_trl.loss_prompts": STEP,
    "longstraw_trl.loss_entropy_mask": STEP,
    "longstraw_trl.loss_router_aux": STEP,
    "longstraw_trl.loss_replays": STEP,
    "longstraw_trl.prompt_state_manager": STEP,
    "longstraw_trl.streamed_loss": STEP,
    "longstraw_trl.rollout": STEP,
    "longstraw_trl.checks": GLUE,
    "longstraw_trl.checkpoint": GLUE,
    "longstraw_trl.rewards": GLUE,
    "longstraw_trl.agents": GLUE,
    "longstraw_trl.trainer": GLUE,
    "longstraw_trl": GLUE,  # the package's __init__ wires the layers together
    "longstraw_trl.__main__": GLUE,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):  # subpackages too (kernels/<op>/)
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            mods[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return mods


MODULES = _modules()


def _layer(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    for package in (
        "longstraw_trl.kernels",
        "longstraw_trl.model_patches",
    ):  # a subpackage's modules: its layer
        if module.startswith(package + "."):
            return LAYERS[package]
    raise AssertionError(
        f"{module} has no layer: add it to LAYERS in {Path(__file__).name} and docs/design.md"
    )


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The first-party modules a ``from ... import ...`` reaches (a submodule named in the list counts as one)."""
    if node.level:
        base = module.split(".")
        if MODULES[module].stem != "__init__":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("longstraw_trl"):
        return []
    found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return found or [target]


def _imports():
    """(module, target, names, where) for every first-party import; ``where``: top, type_checking or function."""
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.startswith("longstraw_trl") for a in node.names):
                raise AssertionError(f"{module}: use `from ... import ...` for first-party imports")
            if not isinstance(node, ast.ImportFrom):
                continue
            where, p = "top", parents.get(node)
            while p is not None:
                if isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef):
                    where = "function"
                    break
                if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test):
                    where = "type_checking"
                p = parents.get(p)
            for target in _resolve(module, node):
                out.append((module, target, [a.name for a in node.names], where, node.lineno))
    return out


IMPORTS = _imports()


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_go_down_the_layers():
    wrong = [
        f"{m}:{line} ({LAYER_NAMES[_layer(m)]}) imports {t} ({LAYER_NAMES[_layer(t)]})"
        for m, t, _, _, line in IMPORTS
        if m != t and _layer(t) > _layer(m)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, t, _, where, _ in IMPORTS:
        if where != "function" and t != m and t in graph:
            graph[m].add(t)
    done, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m) :] + [m])
            return
        if m in done:
            return
        on_path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_local_first_party_imports():
    local = [
        f"{m}:{line} imports {t} inside a function"
        for m, t, _, where, line in IMPORTS
        if where == "function" and m != "longstraw_trl"  # the package's lazy `__getattr__` (TRL, Triton)
    ]
    assert not local, "\n".join(local)


def test_no_private_name_crosses_a_module():
    private = [
        f"{m}:{line} imports {n} from {t}"
        for m, t, names, _, line in IMPORTS
        for n in names
        if n.startswith("_") and t != m
    ]
    assert not private, "\n".join(private)


def _trl_privates() -> set[str]:
    from trl import GRPOTrainer

    trl_source = Path(inspect.getfile(GRPOTrainer)).read_text()
    names = {n for n in dir(GRPOTrainer) if n.startswith("_")}
    for node in ast.walk(ast.parse(trl_source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def _own_trainer_privates() -> set[str]:
    """The private names LongStrawGRPOTrainer defines itself (methods and ``self._x`` attributes), not TRL's: TRL's
    own private attributes (``_metrics``, ``_compute_loss``, ...) are what parity tests compare against."""
    from trl import GRPOTrainer

    source = (ROOT / "longstraw_trl" / "trainer.py").read_text()
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    trl_source = Path(inspect.getfile(GRPOTrainer)).read_text()
    return {
        n
        for n in names
        if n.startswith("_")
        and not n.startswith("__")
        and not hasattr(GRPOTrainer, n)
        and f"self.{n} " not in trl_source
    }


# names the tests give our trainer: a private attribute on them that TRL does not define is ours
TRAINER_NAMES = ("trainer", "ours", "tr", "t")


def _private_trainer_uses(path: Path, own: set[str], trl: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (
            node.attr in own
            or (
                isinstance(node.value, ast.Name)
                and node.value.id in TRAINER_NAMES
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in trl
            )
        )
    ] + [
        f"{path.relative_to(ROOT)}:{node.lineno} '{node.value}'"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in own
    ]


def test_agents_and_tests_use_the_trainers_public_surface():
    own = _own_trainer_privates()
    assert "_shard_experts" in own and "_metrics" not in own  # the rule sees ours, not TRL's
    tests = [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != Path(__file__).name]
    paths = [ROOT / "longstraw_trl" / "agents.py", *tests]
    trl = _trl_privates()
    uses = [u for p in paths for u in _private_trainer_uses(p, own, trl)]
    assert not uses, "\n".join(uses)


# The TRL 1.16 hooks LongStrawGRPOTrainer overrides (docs/design.md, "TRL hooks"), with the parameters it was written
# against: a TRL release that renames or reorders one must fail here, not train on something else.
TRL_HOOKS = {
    "_tokenize_prompts": ["self", "prompts"],
    "_generate_single_turn": ["self", "prompt_ids", "images", "multimodal_fields", "num_generations"],
    "_tool_call_loop": None,  # wrapped with *args, **kwargs: only its existence matters
    "_get_per_token_logps_and_entropies": [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ],
    "_generate_and_score_completions": ["self", "inputs"],
    "_prepare_inputs": ["self", "generation_batch"],
    "_compute_loss": ["self", "model", "inputs"],
    "compute_loss": ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    "training_step": ["self", "model", "inputs", "num_items_in_batch"],
    "_save_checkpoint": ["self", "model", "trial"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_clip_grad_norm": ["self", "model"],
    "_get_grad_norm": ["self", "model", "grad_norm"],
}


@pytest.mark.parametrize("hook", sorted(TRL_HOOKS))
def test_trl_hook_signatures(hook):
    from trl import GRPOTrainer

    assert hasattr(GRPOTrainer, hook), (
        f"TRL's GRPOTrainer has no {hook} any more: LongStrawGRPOTrainer overrides it"
    )
    expected = TRL_HOOKS[hook]
    if expected is None:
        return
    params = list(inspect.signature(getattr(GRPOTrainer, hook)).parameters)
    assert params[: len(expected)] == expected, f"TRL's {hook}{params} changed from {expected}"


MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 800


def _is_triton_kernel_code(fn: ast.AST) -> bool:
    """A ``@triton.jit`` body, or the cached builder that defines such bodies (kernel math, not glue)."""
    return any(
        isinstance(n, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in n.decorator_list)
        for n in ast.walk(fn)
    )


def test_functions_and_modules_stay_short():
    """No function over ~100 lines (Triton kernel bodies excepted) and no module over ~800: a longer one holds
    several concerns."""
    long = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        if tree.body and tree.body[-1].end_lineno > MAX_MODULE_LINES:
            long.append(f"{module}: {tree.body[-1].end_lineno} lines")
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_triton_kernel_code(node):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{module}.{node.name}:{node.lineno}: {lines} lines")
    assert not long, "\n".join(long)
