"""The base of every config group's schema: one dataclass per group owns each setting's default, type and rule.

A group's dataclass (``AlgorithmConfig``, ``DataConfig``, ``MemoryConfig``, ...) is the one place its defaults are
written: ``node()`` gives Hydra the composed config's values for the group (``src/config_schema.py`` registers
them, the group's YAML file only changes some), and ``from_dict`` builds it from the composed group, refusing an
unknown key and every bad value with one line naming the key, the value and what is expected. The classes that
use a group take its dataclass, so no constructor writes a default of its own. docs/design.md says why this shape.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, ClassVar, Mapping

from omegaconf import DictConfig, OmegaConf


def follows(key: str, default: Any) -> Any:
    """A field whose value follows another setting: ``${key}`` in the composed config (``key`` itself where it starts
    as an interpolation, ``${paths.data_dir}/models``), ``default`` where the dataclass is built without Hydra (tests,
    scripts)."""
    return dataclasses.field(default=default, metadata={"follows": key})


def followed(schema: type) -> dict[str, str]:
    """``{field: the key it follows}`` for a schema's plain followers (``${data.temperature}``, not a path built from
    one)."""
    return {f.name: f.metadata["follows"] for f in dataclasses.fields(schema)
            if "follows" in f.metadata and "$" not in f.metadata["follows"] and ":" not in f.metadata["follows"]}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a number (a string, a bool, a list, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return float(value)


def int_at_least(key: str, value: Any, low: int, what: str = "") -> list[str]:
    """``["<key>=<value>: expected an int >= <low><what>"]`` unless ``value`` is such an int (None passes)."""
    return [] if value is None or (is_int(value) and value >= low) else [
        f"{key}={value!r}: expected an int >= {low}{what}"]


def one_of(key: str, value: Any, valid: tuple) -> list[str]:
    return [] if value in valid else [f"{key}={value!r}: expected one of {tuple(valid)}"]


@dataclasses.dataclass
class Settings:
    """A config group's settings. ``PREFIX``: the group's path in the config, named in every message."""

    PREFIX: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | Settings | None, prefix: str | None = None) -> Settings:
        """From the composed group (a dict or a resolved DictConfig; missing keys take their defaults, keys starting
        with ``_`` are Hydra's). Nested groups are built from their own dicts.

        Raises:
            ValueError: an unknown key (a typo would fall back to the default without a word) or bad values, one
                line each.
        """
        if isinstance(values, cls):
            return values
        prefix = cls.PREFIX if prefix is None else prefix
        known = {f.name for f in dataclasses.fields(cls)}
        if isinstance(values, DictConfig):
            values = OmegaConf.to_container(values, resolve=True)
        values = {k: v for k, v in dict(values or {}).items() if not str(k).startswith("_")}
        unknown = sorted(set(values) - known)
        if unknown:
            close = [m for k in unknown for m in difflib.get_close_matches(k, known, n=1)]
            hint = f" (did you mean {', '.join(f'{prefix}.{m}' for m in close)}?)" if close else ""
            article = "an" if prefix[:1] in "aeiou" else "a"
            raise ValueError(f"{', '.join(f'{prefix}.{k}' for k in unknown)}: not {article} {prefix} setting{hint}; "
                             f"expected keys among {sorted(known)}")
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            nested = _settings_class(hints[name])
            if nested is not None and isinstance(value, Mapping):
                values[name] = nested.from_dict(value, f"{prefix}.{name}")
        return cls(**values)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        prefix = type(self).PREFIX
        wrong = [p for f in dataclasses.fields(self)
                 if (p := type_problem(f"{prefix}.{f.name}", hints[f.name], getattr(self, f.name)))]
        problems = wrong or self.problems()  # the rules read values of their type; on the values as given
        if problems:
            raise ValueError("\n".join(problems))
        for f in dataclasses.fields(self):  # YAML writes 0 for 0.0: one type per field downstream
            if hints[f.name] in (float, float | None) and is_int(getattr(self, f.name)):
                setattr(self, f.name, float(getattr(self, f.name)))

    def problems(self) -> list[str]:
        """Each bad value as one line naming ``PREFIX.key``, the value and what is expected (none: [])."""
        return []

    @classmethod
    def node(cls) -> dict[str, Any]:
        """The group's defaults as Hydra's ConfigStore holds them (a plain dict: the values are checked here, by
        ``from_dict``, so a bad override gets this project's message, not OmegaConf's)."""
        out = {}
        for f in dataclasses.fields(cls):
            if "follows" in f.metadata:
                key = f.metadata["follows"]
                out[f.name] = key if key.startswith("${") else "${" + key + "}"
                continue
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[f.name] = type(value).node() if isinstance(value, Settings) else value
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def type_problem(key: str, hint: Any, value: Any) -> str | None:
    """``"<key>=<value>: expected <kind>"`` when ``value`` is not of the field type ``hint`` (a bool is not an int, and
    a word is not a bool: YAML's ``no`` arrives as the string 'no'), else None."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in kinds:
        return None
    names = []
    for kind in (k for k in kinds if k is not type(None)):
        origin = typing.get_origin(kind) or kind
        name, ok = {bool: ("true or false", isinstance(value, bool)), int: ("an int", is_int(value)),
                    float: ("a number", number(value) is not None), str: ("a string", isinstance(value, str)),
                    list: ("a list", isinstance(value, list)), dict: ("a mapping", isinstance(value, dict)),
                    }.get(origin, ("its settings", not isinstance(origin, type) or isinstance(value, origin)))
        if ok:
            return None
        names.append(name)
    return f"{key}={value!r}: expected {' or '.join(names + ['null'] * (type(None) in kinds))}"


def _settings_class(hint: Any) -> type[Settings] | None:
    """The ``Settings`` subclass a field's type names (``ValConfig`` or ``ValConfig | None``), else None."""
    for candidate in typing.get_args(hint) or (hint,):
        if isinstance(candidate, type) and issubclass(candidate, Settings):
            return candidate
    return None
