"""Start-up check: do the model states fit in one device's memory for the chosen model, strategy and LoRA setting?
Per device, in bytes (P: model parameters, A: LoRA adapter parameters, W: data-parallel world size, s = W when the
strategy shards (FSDP, FSDP2), else 1):

- full fine-tuning: fp32 master weights ``4P/s`` + gradients ``4P/s`` + AdamW's two moments ``8P/s`` + DDP's
  gradient buckets ``4P`` (W > 1) + a frozen KL reference in the loading dtype ``2P/s`` (bf16) when ``kl_coef > 0``;
- LoRA: the frozen base ``2P/s`` (bf16) + ``16A/s`` for the adapters (+ ``4A`` DDP buckets); the reference is the
  base with adapters off, or a frozen merged copy ``2P/s`` when LoRA continues a loaded adapter;
- FSDP: the root module plus two decoder layers gathered, with their gradients, in the compute dtype;
- bf16 decoding steps: a bf16 copy, ``2`` bytes per parameter not already bf16 (``rollout_engine.InferenceCopy``).

Parameters are counted on the meta device from ``config.json`` alone. Activations, the KV cache and the CUDA context
are not estimated: a run is refused when the model states alone exceed ``usable_fraction`` of the device memory."""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from src.models.policy_config import LoraConfig as PolicyLora, PolicyConfig

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class ParamCounts:
    """``total`` (base model), ``adapters`` (LoRA, 0 without), ``gathered`` (root module + two decoder layers: what FSDP
    holds unsharded during a forward pass)."""

    total: int
    adapters: int
    gathered: int


def count_parameters(path: str, lora: dict | None = None) -> ParamCounts:
    """The parameter counts of the model at ``path`` (hub id or directory), from its config on the meta device."""
    return _count_parameters(path, json.dumps(lora or {}, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _count_parameters(path: str, lora_json: str) -> ParamCounts:
    from transformers import AutoModelForCausalLM

    from src.models.hub import adapter_base_model, base_model_setting, load_config

    lora = PolicyLora.from_dict(json.loads(lora_json))
    base = adapter_base_model(path)
    config = load_config(base, base_model_setting(path)) if base else load_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    layers = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    gathered = total - sum(layer_sizes) + 2 * max(layer_sizes, default=0)
    adapters = 0
    if lora.enabled:
        from peft import LoraConfig, get_peft_model

        if base is not None:  # the loaded adapter is trained, with its own shape
            lora_config = LoraConfig.from_pretrained(path)
            lora_config.inference_mode = False  # saved as True, which would freeze the adapters counted here
        else:
            lora_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                     task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, lora_config)
        adapters = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return ParamCounts(total, adapters, gathered)


def estimate_per_device(counts: ParamCounts, *, world: int, sharded: bool, reference: bool, weight_bytes: int,
                        master_bytes: int = 4, compute_bytes: int = 2, inference_copy: bool = False
                        ) -> dict[str, float]:
    """Bytes per device of each part of the model states (module docstring). ``reference``: a frozen copy is the KL
    reference; ``weight_bytes``: per frozen weight; ``master_bytes``: per trainable parameter (and its gradient and
    each AdamW moment); ``compute_bytes``: per parameter FSDP gathers; ``inference_copy``: bf16 decoding steps."""
    s = world if sharded else 1
    lora = counts.adapters > 0
    trainable = counts.adapters if lora else counts.total
    parts = {"trainable weights": trainable * master_bytes / s, "gradients": trainable * master_bytes / s,
             "AdamW states": 2 * trainable * master_bytes / s}
    if lora:
        parts["frozen base"] = counts.total * weight_bytes / s
    if reference:
        parts["frozen reference"] = counts.total * weight_bytes / s
    if not sharded and world > 1:
        parts["DDP gradient buckets"] = trainable * master_bytes
    if sharded and world > 1:
        parts["FSDP gathered params+grads"] = 2 * counts.gathered * compute_bytes
    copied = trainable * (master_bytes != 2) + (counts.total * (weight_bytes != 2) if lora else 0)
    if inference_copy and copied:
        parts["bf16 inference copy"] = 2 * copied
    return parts


def _world_size(trainer: dict[str, Any]) -> int:
    devices = trainer["devices"]
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif isinstance(devices, str) and "," in devices:
        n = len([d for d in devices.split(",") if d.strip()])
    elif devices in ("auto", -1, "-1"):
        n = max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    else:
        n = int(devices)
    return n * int(trainer.get("num_nodes", 1) or 1)


def device_memory_bytes(accelerator: str, configured_gib: float) -> tuple[float, str]:
    """One device's memory: the GPU's when one is visible (and the accelerator may use it), else the config's."""
    if str(accelerator) in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), props.name
    return float(configured_gib) * GIB, "memory_check.device_memory_gib"


def _describe(parts: dict[str, float]) -> str:
    return " + ".join(f"{name} {b / GIB:.1f}" for name, b in parts.items())


def check_device_memory(cfg) -> dict[str, float] | None:
    """Refuse a run whose model states cannot fit in one device's memory (``cfg.memory_check``); log the estimate
    otherwise. Returns the per-device estimate in bytes by part (None when the check is disabled). Raises ValueError
    over ``usable_fraction`` of the device memory, giving the estimate and the changes that would fit."""
    from omegaconf import OmegaConf

    from src.models.hub import resolve_name_or_path
    from src.models.policy import reference_is_a_copy
    from src.models.precision import torch_dtype
    from src.utils.startup_checks import BF16_DECODE
    from src.utils.startup_checks import sharded as strategy_sharded, strategy_name

    check = cfg.memory_check
    if not check.enabled:
        return None
    policy = OmegaConf.to_container(cfg.model.policy, resolve=True)
    settings = PolicyConfig.from_dict(policy)
    trainer = {k: OmegaConf.select(cfg, f"trainer.{k}") for k in ("strategy", "devices", "num_nodes", "precision",
                                                                     "accelerator")}
    if OmegaConf.is_config(trainer["strategy"]):
        trainer["strategy"] = OmegaConf.to_container(trainer["strategy"], resolve=True)
    lora = dict(policy.get("lora") or {})
    path = resolve_name_or_path(policy["name_or_path"], policy["cache_dir"])
    world, sharded = _world_size(trainer), bool(strategy_sharded(trainer))
    sizes = dict(weight_bytes=torch_dtype(settings.dtype).itemsize,
                 master_bytes=torch_dtype(settings.master_dtype).itemsize,
                 compute_bytes=2 if "16" in str(trainer.get("precision")) else 4, world=world)
    kl = float(cfg.algorithm.kl_coef) > 0
    counts = count_parameters(path, lora)
    reference = kl and reference_is_a_copy(policy)
    parts = estimate_per_device(counts, sharded=sharded, reference=reference, **sizes,
                                inference_copy=settings.rollout_precision in BF16_DECODE)
    memory, source = device_memory_bytes(trainer["accelerator"], check.device_memory_gib)
    limit = memory * float(check.usable_fraction)
    total = sum(parts.values())
    how = f"LoRA r={settings.lora.r}" if settings.lora.enabled else "full fine-tuning"
    what = (f"{how} of {policy['name_or_path']} ({counts.total / 1e9:.2f}B parameters) on {world} device(s) "
            f"({'sharded' if sharded else 'replicated'}: trainer.strategy={strategy_name(trainer.get('strategy'))})")
    if total <= limit:
        log.info("Memory estimate: %.1f GiB per device of %.1f GiB (%s) for %s: %s GiB", total / GIB, memory / GIB,
                 source, what, _describe(parts))
        return parts
    fixes = []
    if not sharded:
        fixes.append(("trainer=fsdp", estimate_per_device(counts, sharded=True, reference=reference, **sizes)))
    if not lora.get("enabled"):
        lora_on = {**lora, "enabled": True}
        with_lora = count_parameters(path, lora_on)
        sizes["reference"] = kl and reference_is_a_copy({**policy, "lora": lora_on})
        fixes.append(("model.policy.lora.enabled=true", estimate_per_device(with_lora, sharded=sharded, **sizes)))
        if not sharded:
            fixes.append(("trainer=fsdp model.policy.lora.enabled=true",
                          estimate_per_device(with_lora, sharded=True, **sizes)))
    fitting = [f"{name} (~{sum(p.values()) / GIB:.1f} GiB per device)" for name, p in fixes if sum(p.values()) <= limit]
    advice = ("Use " + ", or ".join(fitting[:2]) if fitting
              else "Neither FSDP nor LoRA is enough here: use more devices or a smaller model")
    raise ValueError(
        f"The model states of {what} need ~{total / GIB:.1f} GiB per device ({_describe(parts)} GiB), but a device "
        f"has {memory / GIB:.1f} GiB ({source}) and at most {check.usable_fraction:.0%} of it can hold "
        f"them (activations and the KV cache need the rest). {advice}. "
        f"(Estimate: src/models/memory_estimate.py; skip with memory_check.enabled=false.)")
