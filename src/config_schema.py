"""Hydra's view of the config groups' schemas: each group's defaults come from its dataclass (``Settings.node``), an
environment's from its class's constructor, so a group's YAML file writes only what it changes and a default is
written once (docs/design.md, "One place per setting"). Registered when ``src`` is imported, before any config is
composed; nothing here imports torch or a simulator."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def constructor_defaults(target: str) -> dict[str, Any]:
    """The keyword defaults of the constructor of the class ``target`` names (``src.envs.webshop.WebShopEnv``: in its
    module's file, or in a file of its package), read without importing it (a simulator's import takes seconds).

    Raises:
        ValueError: a default that is not a literal.
    """
    module, _, class_name = target.rpartition(".")
    base = ROOT / module.replace(".", "/")
    files = [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else sorted(base.glob("*.py"))
    classes = [n for f in files for n in ast.parse(f.read_text()).body if isinstance(n, ast.ClassDef)]
    cls = next((n for n in classes if n.name == class_name), None)
    if cls is None:
        raise ValueError(f"env _target_ {target!r}: no class {class_name} in {module} (configs/env/*.yaml)")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    named = init.args.args[-len(init.args.defaults):] if init.args.defaults else []
    pairs = list(zip(named, init.args.defaults)) + list(zip(init.args.kwonlyargs, init.args.kw_defaults))
    try:
        return {arg.arg: ast.literal_eval(default) for arg, default in pairs if default is not None}
    except ValueError as err:
        raise ValueError(f"{target}.__init__: a default that is not a literal ({err}); an environment's defaults are "
                         "its config schema and must be written as values") from err


def register_schemas() -> None:
    """Store each group's defaults as ``<group>/schema`` in Hydra's ConfigStore (its YAML files list it first)."""
    from hydra.core.config_store import ConfigStore

    from src.data.rollout_config import DataConfig
    from src.memory.settings import MemoryConfig
    from src.models.algorithm_config import AlgorithmConfig
    from src.models.policy_config import PolicyConfig
    from src.models.warm_start_config import WarmStartConfig

    store = ConfigStore.instance()
    for group, schema in (("data", DataConfig), ("algorithm", AlgorithmConfig), ("memory", MemoryConfig)):
        store.store(group=group, name="schema", node=schema.node(), package=group)
    store.store(group="model", name="schema", node={"policy": PolicyConfig.node()}, package="model")
    store.store(group="warm_start", name="schema", node=WarmStartConfig.node(), package="model.warm_start")
    for path in sorted((ROOT / "configs" / "env").glob("*.yaml")):  # each as <name>_schema, from its _target_
        defaults = constructor_defaults(yaml.safe_load(path.read_text())["_target_"])
        store.store(group="env", name=f"{path.stem}_schema", node=defaults, package="env")
