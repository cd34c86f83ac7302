"""OmegaConf resolvers the configs use, registered when the ``src`` package is imported.

``${pid:}``: this process's id; run directories are ``<time>_<pid>``, so runs started in the same second never share
one. ``${env_default:${env._target_},novelty_coef}``: a class attribute of the environment class a target names.
"""
from __future__ import annotations

import os

from omegaconf import OmegaConf


def env_default(target: str, name: str):
    """The class attribute ``name`` of the class ``target`` names.

    Raises:
        AttributeError: the class has no such attribute.
    """
    import hydra

    cls = hydra.utils.get_class(target)
    if not hasattr(cls, name):
        raise AttributeError(f"{target} has no default {name!r} (src.envs.base.Environment lists them)")
    return getattr(cls, name)


def register_resolvers() -> None:
    """Register the resolvers (idempotent)."""
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)
    if not OmegaConf.has_resolver("env_default"):
        OmegaConf.register_new_resolver("env_default", env_default)
