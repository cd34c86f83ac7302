"""Which tensors are float32 and which bf16. Trainable parameters are float32 *master weights*
(``model.policy.master_dtype``): AdamW at lr 1e-6 changes a N(0, 0.02) weight by far less than bf16's resolution,
so a bf16 parameter keeps ~2% of its updates. Compute is bf16 where the Trainer asks for it; frozen weights stay in
the loading dtype ``model.policy.dtype``; log-probs come from logits upcast to float32."""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``; raises ValueError for a name that is not a floating-point torch dtype."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a floating-point torch dtype; expected e.g. 'float32' or 'bfloat16'")
    return dtype


def master_dtype(name: str) -> torch.dtype:
    """The dtype of trainable parameters; warns when it cannot hold small updates (below float32)."""
    dtype = torch_dtype(name)
    if torch.finfo(dtype).eps > torch.finfo(torch.float32).eps:
        log.warning("model.policy.master_dtype=%s: trainable parameters are stored in %s, so AdamW updates smaller "
                    "than ~%.1g of a weight are rounded away (at lr 1e-6 most entries never change); use "
                    "model.policy.master_dtype=float32 (compute stays bf16 under bf16-mixed)", name, name,
                    torch.finfo(dtype).eps / 2)
    return dtype


def fsdp_mixed_precision(trainer_precision: str):
    """FSDP2 ``MixedPrecisionPolicy`` for a Lightning precision: under ``bf16-mixed`` (``16-mixed``) parameters are
    all-gathered in bf16 (fp16) and gradients reduce-scattered in fp32, the sharded master weights keeping their dtype
    (the verl/torchtitan setting); otherwise no casting."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = str(trainer_precision)
    if precision.startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision.startswith("16"):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_trainable_dtype(model: nn.Module, expected: torch.dtype, trainer_precision: str) -> str:
    """A one-line summary of the parameter layout, once training is set up (after any precision plugin or sharding).
    Raises RuntimeError for a trainable parameter not ``expected`` (``trainer.precision=bf16-true`` casts to bf16)."""
    counts: dict[tuple[bool, torch.dtype], int] = {}
    for p in model.parameters():
        key = (p.requires_grad, p.dtype)
        counts[key] = counts.get(key, 0) + p.numel()
    wrong = {str(dtype): n for (trainable, dtype), n in counts.items() if trainable and dtype != expected}
    if wrong:
        raise RuntimeError(f"trainable parameters must be {expected} master weights, but {wrong} (dtype: count) are "
                           f"not (trainer.precision={trainer_precision}); use trainer.precision=bf16-mixed for bf16 "
                           f"compute with fp32 master weights")
    parts = [f"{n / 1e6:,.1f}M {'trainable' if trainable else 'frozen'} {str(dtype).removeprefix('torch.')}"
             for (trainable, dtype), n in sorted(counts.items(), key=lambda kv: (not kv[0][0], str(kv[0][1])))]
    return f"parameters: {', '.join(parts)}; trainer.precision={trainer_precision}"
