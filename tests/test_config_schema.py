"""Each default of the composed default config is written in one place (docs/design.md, "One place per setting").

A setting's default may be written in a group's schema (its ``Settings`` dataclass, or an environment's constructor),
in a YAML file the default composition reads, or as the default of a parameter of the code that takes the group
(a constructor, ``build_policy``) or of a ``.get("<key>", <default>)`` that reads it. Written twice, the two drift
apart (``memory.tip_memory.threshold`` was 0.5 in three files; ``data.history_length`` 3 in the YAML and 5 in two
constructors). Read with ``ast`` and Hydra's compose, without building anything.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]

# The code that takes each group's settings as parameters (the group's path: where its keys start).
TAKERS = {
    "data": ["src.data.rollout_datamodule:RolloutDataModule.__init__", "src.data.rollout_config:RolloutConfig"],
    "memory": ["src.callbacks.memory:MemoryCallback.__init__"],
    "memory.tip_memory": ["src.memory.tip_memory:TipMemory.__init__"],
    "memory.novelty": ["src.memory.novelty:NoveltyMemory.__init__"],
    "memory.embedder": ["src.memory.embedder:Embedder.__init__"],
    "model": ["src.models.empo2_module:EMPO2Module.__init__"],
    "model.policy": ["src.models.policy:build_policy", "src.models.policy:Policy.__init__"],
    "callbacks.model_checkpoint": ["src.callbacks.checkpoint:IterationCheckpoint.__init__"],
}
# ``.get("<key>", <literal>)`` calls in src/ whose key is a config leaf's name but that read something else.
NOT_CONFIG_READS = {
    ("src/callbacks/memory.py", "key"),  # a checkpoint's saved memory state: older ones held no key, and had this one
}


def _compose(*overrides: str, configs: Path = ROOT / "configs"):
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def _literal(value) -> bool:
    return not (isinstance(value, str) and "${" in value)  # an interpolation follows another setting


def _yaml_places(cfg, configs: Path = ROOT / "configs") -> dict[str, list[str]]:
    """key -> the YAML files of the composition that write a literal value for it."""
    choices = {g: c for g, c in OmegaConf.to_container(cfg.hydra.runtime.choices).items()
               if c and not g.startswith("hydra") and (configs / g / f"{c}.yaml").is_file()}
    files = [(configs / "train.yaml", "")] + [(configs / g / f"{c}.yaml", g) for g, c in choices.items()]
    places: dict[str, list[str]] = {}
    for path, group in files:
        text = path.read_text()
        package = "" if "@package _global_" in text or not group else group + "."
        body = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k != "defaults"}
        for key, value in _flat(body, package).items():
            if _literal(value) and not key.split(".")[-1].startswith("_"):
                places.setdefault(key, []).append(str(path.relative_to(configs.parent)))
    return places


def _schema_places(cfg) -> dict[str, tuple[object, str]]:
    """key -> (default, where) for each literal default of the schemas the composition read."""
    places = {}
    for group, choice in OmegaConf.to_container(cfg.hydra.runtime.choices).items():
        entries = ConfigStore.instance().repo.get(group) or {}
        name = next((n for n in ("schema.yaml", f"{choice}_schema.yaml") if n in entries), None)
        if name is None:
            continue
        for key, value in _flat(OmegaConf.to_container(entries[name].node, resolve=False), f"{group}.").items():
            if _literal(value):
                places[key] = (value, f"{group}/{name} (schema)")
    return places


def _parameter_defaults(spec: str) -> dict[str, str]:
    """name -> where, for each parameter (or dataclass field) of ``spec`` whose default is written as a literal."""
    import importlib

    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    node = ast.parse(inspect.getsource(obj).lstrip() if not inspect.isclass(obj) else
                     inspect.getsource(obj)).body[0]
    out = {}
    if isinstance(node, ast.ClassDef):  # a dataclass: its fields
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and item.value is not None and _is_literal(item.value):
                out[item.target.id] = spec
        return out
    args = node.args
    pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg: spec for a, d in pairs if _is_literal(d)}


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


def _get_defaults(leaf_names: set[str]) -> dict[tuple[str, object], list[str]]:
    """(leaf name, default) -> ``file:line`` of each ``.get("<name>", <literal default>)`` in src/."""
    out: dict[tuple[str, object], list[str]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in leaf_names and _is_literal(node.args[1])
                    and (rel, node.args[0].value) not in NOT_CONFIG_READS):
                key = (node.args[0].value, repr(ast.literal_eval(node.args[1])))
                out.setdefault(key, []).append(f"{rel}:{node.lineno}")
    return out


def written_twice(cfg, configs: Path = ROOT / "configs") -> dict[str, list[str]]:
    """Each leaf of ``cfg`` written in more than one place, with the places."""
    leaves = _flat(OmegaConf.to_container(cfg, resolve=False))
    leaves = {k: v for k, v in leaves.items() if not k.startswith("hydra.") and not k.rsplit(".", 1)[-1][0] == "_"}
    places = {k: list(v) for k, v in _yaml_places(cfg, configs).items()}
    for key, (default, where) in _schema_places(cfg).items():
        if key not in places or leaves.get(key) == default:  # a YAML file changing a schema default is a preset
            places.setdefault(key, []).append(where)
    for prefix, specs in TAKERS.items():
        for spec in specs:
            for name, where in _parameter_defaults(spec).items():
                if f"{prefix}.{name}" in leaves:
                    places.setdefault(f"{prefix}.{name}", []).append(f"{where} (parameter default)")
    gets = _get_defaults({k.rsplit(".", 1)[-1] for k in leaves})
    for key, value in leaves.items():  # the same default again where the setting is read
        where = gets.get((key.rsplit(".", 1)[-1], repr(value)), [])
        places.setdefault(key, []).extend(f"{w} (.get default)" for w in where)
    return {k: v for k, v in places.items() if k in leaves and len(v) > 1}


def test_each_default_of_the_default_config_is_written_once():
    twice = written_twice(_compose())
    assert not twice, "defaults written in more than one place:\n" + "\n".join(
        f"{k}: {', '.join(v)}" for k, v in sorted(twice.items()))


def test_a_restated_default_is_found(tmp_path, monkeypatch):
    """The check sees a default restated in a YAML group file and in a constructor (the two ways it came back)."""
    cfg = _compose()
    places = _yaml_places(cfg)
    assert "memory.tip_memory.threshold" not in places  # the schema's alone
    import src.memory.tip_memory as tip_memory

    source = inspect.getsource(tip_memory.TipMemory.__init__).replace("**values", "threshold: float = 0.5, **values")
    monkeypatch.setattr(inspect, "getsource", lambda obj, _real=inspect.getsource: source
                        if obj is tip_memory.TipMemory.__init__ else _real(obj))
    assert "memory.tip_memory.threshold" in written_twice(cfg)
    monkeypatch.undo()
    import shutil

    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", configs)
    with (configs / "memory" / "empo2.yaml").open("a") as f:
        f.write("tip_memory:\n  top_k: 10\n")
    assert "memory.tip_memory.top_k" in written_twice(_compose(configs=configs), configs)


@pytest.mark.parametrize("group", ["data", "memory", "algorithm"])
def test_every_setting_of_a_schema_group_is_in_the_composed_config(group):
    """The schema is what Hydra composes: every field is a key a command line can override without ``+``."""
    cfg = _compose()
    node = ConfigStore.instance().repo[group]["schema.yaml"].node
    assert set(OmegaConf.to_container(node)) <= set(cfg[group])
