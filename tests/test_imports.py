"""The import structure of ``src/``: no import cycle, and the layers import downwards only.

Read with ``ast``, without importing anything: every ``import src...`` / ``from src... import ...`` counts, at
module level, inside functions and under ``if TYPE_CHECKING:`` alike (a type-only import still ties the two
modules together for a reader).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Dotted module name (``src.data.rollout``; a package by its ``__init__``) → file, for every ``src/**/*.py``."""
    out = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` that ``name`` (a module, or a name inside one) belongs to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``{module: the src modules it imports}``; ``from pkg import mod`` counts as importing ``pkg.mod``."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str | None] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(_owner(a.name, modules) for a in node.names if a.name.split(".")[0] == "src")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] != "src":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in modules else _owner(base, modules))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "src.utils.resolvers" in graph["src"]                      # module level
    assert "src.config_checks" in graph["src.train"]                  # inside a function
    assert "src.data.samples" in graph["src.models.empo2_module"]     # `from src.data.samples import ...`


def test_no_import_cycle_in_src():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in src/: " + " -> ".join(cycle)


# The modules at the top of src/: the entry points and what only they build on (warm start, export, run settings).
TOP = ("src.train", "src.eval", "src.sft", "src.export", "src.warm_start", "src.model_export",
       "src.checkpoint_settings", "src.config_checks")
# What each layer may not import: a lower layer knows nothing of the ones above it (docs/design.md).
FORBIDDEN = {
    "src.utils": ("src.envs", "src.memory", "src.models", "src.data", "src.callbacks", "src.evaluation") + TOP,
    "src.envs": ("src.memory", "src.models", "src.data", "src.callbacks", "src.evaluation") + TOP,
    "src.memory": ("src.models", "src.data", "src.callbacks", "src.evaluation", "src.envs") + TOP,
    # the model layer reads the data it trains on from src.data.samples only
    "src.models": ("src.data.rollout", "src.data.rollout_datamodule", "src.data.demonstrations",
                   "src.data.step_prompt", "src.data.prompts", "src.data.iteration", "src.data.minibatches",
                   "src.data.reflection_prompt", "src.data.reflections", "src.data.rollout_config",
                   "src.callbacks", "src.evaluation", "src.envs") + TOP,
    "src.data": ("src.callbacks", "src.evaluation") + TOP,
    "src.callbacks": ("src.evaluation",) + TOP,
    "src.evaluation": TOP,
}
# The arrows that run up on purpose, each with its reason in docs/design.md ("Arrows that run up").
DECLARED = {
    # the evaluation run is src/eval.py's body: without a checkpoint it evaluates the warm start, which it builds
    ("src.evaluation.runner", "src.warm_start"),
    # ... and it checks the env settings and reads the command line as the entry points do
    ("src.evaluation.runner", "src.config_checks"),
    ("src.evaluation.runner", "src.checkpoint_settings"),
    ("src.evaluation.runner", "src.model_checks"),  # the response cap against the model's context window
    # the package itself: its __init__ only registers the config resolvers (src/utils/resolvers.py)
    ("src.utils.entrypoint", "src"),
}


def test_layers_import_downwards_only():
    wrong = []
    for module, deps in sorted(import_graph().items()):
        for layer, forbidden in FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                wrong += [f"{module} imports {d}" for d in sorted(deps) if (module, d) not in DECLARED
                          and any(d == f or d.startswith(f + ".") for f in forbidden)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_every_declared_arrow_is_still_there():
    graph = import_graph()
    assert [(m, d) for m, d in sorted(DECLARED) if d not in graph.get(m, ())] == []


def test_nothing_in_src_imports_the_study_tooling():
    """``studies/`` (comparisons of runs, merging adaptation arms, reading the per-episode tables) builds on ``src``;
    the product never imports it."""
    hits = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            hits += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "studies"]
    assert not hits, "src/ imports studies/:\n" + "\n".join(hits)


def test_no_module_outside_src_envs_names_a_concrete_environment():
    """Everything environment-specific lives with the environment (``src.envs.base.Environment``): the rest of
    ``src`` reads it from the class, so a new environment changes nothing outside ``src/envs/``."""
    import ast

    from src.envs.base import Environment
    from src.envs.scienceworld import ScienceWorldEnv  # noqa: F401 - every concrete class is known below
    from src.envs.textworld_express import TextWorldExpressEnv  # noqa: F401
    from src.envs.webshop import WebShopEnv  # noqa: F401

    def subclasses(cls):
        return {c for s in cls.__subclasses__() for c in {s} | subclasses(s)}

    names = {c.__name__ for c in subclasses(Environment) if c.__module__.startswith("src.envs")}
    assert {"ScienceWorldEnv", "WebShopEnv", "TextWorldExpressEnv"} <= names
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        if path.is_relative_to(ROOT / "src" / "envs"):
            continue
        words = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        words |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        words |= {a.name.rsplit(".", 1)[-1] for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.ImportFrom) for a in n.names}
        found += [f"{path.relative_to(ROOT)}: {w}" for w in sorted(words & names)]
    assert not found, "environment classes named outside src/envs/:\n" + "\n".join(found)
