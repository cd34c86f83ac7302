"""What a training checkpoint holds of the policy, and putting it back (docs/usage.md#what-a-checkpoint-holds): with
LoRA only the adapters, plus ``checkpoint["policy_base"]`` (base model, LoRA settings, SHA-256 of the frozen
weights, which the rebuilt policy must match); ``checkpoint["iteration"]`` and ``checkpoint["validation"]``."""
from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

BASE_KEY = "policy_base"
VALIDATION_KEY = "validation"
RUN_CONFIG_KEY = "run_config"  # the resolved training config (src/config_checks.py compares it on resume)
PREFIX = "policy."


def frozen_weights_sha256(policy: nn.Module, stored: set[str]) -> tuple[str, int]:
    """(SHA-256, number of elements) over the names, dtypes, shapes and bytes of the ``policy.state_dict()`` entries
    not in ``stored``, in order, copied to the CPU tensor by tensor."""
    h, n = hashlib.sha256(), 0
    for name, tensor in policy.state_dict().items():
        if name in stored:
            continue
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy())
        n += t.numel()
    return h.hexdigest(), n


def lora_enabled(policy_cfg: dict[str, Any]) -> bool:
    lora = policy_cfg.get("lora")  # None for the frozen KL reference
    return bool(lora and lora["enabled"])


def base_record(policy: nn.Module, policy_cfg: dict[str, Any], stored: set[str]) -> dict[str, Any]:
    """The ``policy_base`` entry: ``name_or_path``, ``lora``, ``dtype``, and ``sha256`` / ``num_elements`` of the
    weights not in ``stored``."""
    sha, n = frozen_weights_sha256(policy, stored)
    return {"name_or_path": str(policy_cfg["name_or_path"]), "lora": dict(policy_cfg.get("lora") or {}),
            "dtype": str(policy_cfg["dtype"]), "sha256": sha, "num_elements": n}


def keep_trainable(checkpoint: dict[str, Any], policy: nn.Module) -> set[str]:
    """Keep only the policy's trainable parameters in ``checkpoint["state_dict"]``; returns their names (no prefix)."""
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                if k.startswith(PREFIX) and k[len(PREFIX):] in trainable}
    return trainable


def check_adapter_checkpoint(policy: nn.Module, checkpoint: dict[str, Any], policy_base: str = "?") -> set[str]:
    """Check that an adapter-only checkpoint holds exactly ``policy``'s adapters and that the policy's other weights
    are its base (same SHA-256); returns the stored names. Raises ValueError, naming the checkpoint's base model and
    LoRA settings, for adapters missing, unknown or of other shapes, or other base weights."""
    record = checkpoint[BASE_KEY]
    stored = {k[len(PREFIX):] for k in checkpoint["state_dict"] if k.startswith(PREFIX)}
    params = policy.state_dict()
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    lora = f"(LoRA settings {record['lora']})"
    unknown = sorted(stored - set(params))
    if unknown:
        raise ValueError(f"the checkpoint's adapter weights {unknown[:3]} are not in the policy: it was trained on "
                         f"{record['name_or_path']!r} {lora}; build the policy with those settings")
    state = checkpoint["state_dict"]
    reshaped = [n for n in sorted(stored) if tuple(state[PREFIX + n].shape) != tuple(params[n].shape)]
    if reshaped:
        n = reshaped[0]
        raise ValueError(f"the checkpoint's adapter weight {n} has shape {tuple(state[PREFIX + n].shape)}, the "
                         f"policy's {tuple(params[n].shape)}: it was trained with {lora}; build the policy with those")
    missing = sorted(trainable - stored)
    if missing:
        raise ValueError(f"the checkpoint holds no weights for the trainable parameters {missing[:3]} "
                         f"({len(missing)} in all): it was trained on {record['name_or_path']!r} {lora}")
    sha = frozen_weights_sha256(policy, stored)[0]
    if sha != record["sha256"]:
        raise ValueError(
            f"the checkpoint's LoRA adapters were trained on the base model {record['name_or_path']!r} "
            f"(dtype {record['dtype']}, weights sha256 {record['sha256'][:16]}...), but this policy's base model "
            f"{policy_base!r} has other weights (sha256 {sha[:16]}...). Resume or load it with the base it was "
            f"trained on (model.policy.name_or_path={record['name_or_path']}, model.policy.dtype={record['dtype']}).")
    return stored


def load_policy_weights(policy: nn.Module, checkpoint: dict[str, Any], where: str, policy_base: str = "?") -> None:
    """Load the checkpoint's policy weights: all of a full checkpoint, or an adapter-only one's adapters after
    ``check_adapter_checkpoint``. Raises ValueError naming ``where``: no ``policy.*`` weights, weights that do not
    fit, or another base model."""
    state = {k[len(PREFIX):]: v for k, v in checkpoint.get("state_dict", {}).items() if k.startswith(PREFIX)}
    if not state:
        raise ValueError(f"checkpoint {where!r} holds no 'policy.*' weights: not a src/train.py checkpoint?")
    if BASE_KEY in checkpoint:
        try:
            check_adapter_checkpoint(policy, checkpoint, policy_base)
        except ValueError as exc:
            raise ValueError(f"checkpoint {where!r}: {exc}") from exc
        policy.load_state_dict(state, strict=False)
        return
    own = policy.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    reshaped = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(state) & set(own))
                if tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or reshaped:
        parts = [f"{len(v)} {name} (e.g. {', '.join(v[:2])})" for name, v in
                 (("weights missing", missing), ("unknown weights", unexpected), ("shapes differ", reshaped)) if v]
        raise ValueError(f"checkpoint {where!r} does not fit the configured model {policy_base!r}: "
                         f"{'; '.join(parts)}. Use the model=... (and LoRA settings) it was trained with.")
    policy.load_state_dict(state, strict=True)


def rebuild_policy_config(checkpoint: dict[str, Any], policy_cfg: dict[str, Any]) -> dict[str, Any]:
    """``policy_cfg`` with the base model and LoRA settings an adapter-only checkpoint records (its adapters fit only
    that base)."""
    record = checkpoint.get(BASE_KEY)
    if record is None:
        return dict(policy_cfg)
    if record["name_or_path"] != policy_cfg.get("name_or_path"):
        log.info("The checkpoint's LoRA adapters were trained on %s: the policy is built on it (not on %s)",
                 record["name_or_path"], policy_cfg.get("name_or_path"))
    return {**policy_cfg, "name_or_path": record["name_or_path"], "lora": record["lora"], "dtype": record["dtype"]}


def check_finite(policy: nn.Module) -> list[str]:
    """Names of the policy parameters holding NaN or inf (under FSDP2: in this rank's shard)."""
    bad = []
    for name, p in policy.named_parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard
        if not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad
