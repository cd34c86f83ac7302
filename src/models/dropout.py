"""Training without dropout: every dropout probability of a policy set to 0 when it is built.

In train mode any dropout makes the first update's PPO ratio differ from 1 (the old log-probs were taken without
it): ``lora.dropout=0.1`` gave ratio_max 1.043, ``attention_dropout=0.1`` 1.022. RL frameworks (TRL, verl) turn
dropout off for the policy; so does ``build_policy`` with these two helpers (docs/robustness.md).
"""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig


def zero_config_dropout(config: PretrainedConfig, prefix: str = "") -> dict[str, float]:
    """Set every non-zero dropout probability of a model config to 0, in place, nested configs included.

    Dropout fields are the numeric ones whose name contains ``dropout`` or ends in ``pdrop`` (``attention_dropout``,
    ``hidden_dropout_prob``, ``resid_pdrop`` ...). Returns ``{field: old value}`` of the fields changed.
    """
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
    """Set ``p`` of every dropout module (``nn.Dropout`` and its relatives) and every float module attribute named
    ``*dropout*`` (some layers copy the config's value at construction) to 0, in place.

    Returns ``{old probability: number of modules or attributes}`` of what was changed.
    """
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
