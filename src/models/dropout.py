"""Every dropout probability of a policy set to 0 when it is built: in train mode any dropout makes the first
update's PPO ratio differ from 1 (the old log-probs were taken without it). TRL and verl do the same
(docs/robustness.md)."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig


def zero_config_dropout(config: PretrainedConfig, prefix: str = "") -> dict[str, float]:
    """Set every non-zero dropout field of a config (numeric, named ``*dropout*`` or ``*pdrop``) to 0, in place, nested
    configs included; returns ``{field: old value}``."""
    zeroed = {}
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            zeroed.update(zero_config_dropout(value, f"{prefix}{key}."))
        elif ("dropout" in key or key.endswith("pdrop")) and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value != 0:
            setattr(config, key, 0.0)
            zeroed[prefix + key] = value
    return zeroed


def zero_module_dropout(model: nn.Module) -> dict[float, int]:
    """Set ``p`` of every dropout module and every float attribute named ``*dropout*`` (some layers copy the config's
    value) to 0, in place; returns ``{old probability: count}``."""
    zeroed: dict[float, int] = {}
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            zeroed[module.p] = zeroed.get(module.p, 0) + 1
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float) and value > 0:
                zeroed[value] = zeroed.get(value, 0) + 1
                setattr(module, key, 0.0)
    return zeroed
