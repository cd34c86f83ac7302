"""Which tensors are float32 and which bf16 (the precision rule of every training path).

- Trainable parameters are float32 *master weights* (``model.policy.master_dtype``): AdamW at lr 1e-6 changes a
  N(0, 0.02) weight by far less than bf16's resolution (8 bits of mantissa), so a bf16 parameter keeps ~2% of
  its updates and an fp32 one all of them. Gradients and AdamW states follow the parameter dtype.
- Compute is bf16 where the Trainer asks for it: ``bf16-mixed`` autocasts matmuls (one GPU, DDP, CPU); under
  FSDP2 (``trainer=fsdp``) the sharded fp32 master parameters are all-gathered in bf16 for compute and gradients
  are reduced in fp32 (:func:`fsdp_mixed_precision`, the verl/torchtitan setting).
- Frozen weights stay in the loading dtype ``model.policy.dtype`` (bf16 at paper scale): the LoRA base model and
  the frozen KL reference.
- Log-probs are computed from logits upcast to float32 (``log_probs.log_probs_from_logits``).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is not a floating-point torch dtype.
    """
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
    """FSDP2 ``MixedPrecisionPolicy`` for a Lightning precision string: under ``bf16-mixed`` (``16-mixed``),
    parameters are all-gathered in bf16 (fp16) for compute and gradients reduce-scattered in fp32, while the
    sharded parameters (the optimizer's master weights) keep their own dtype. Otherwise no casting."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = str(trainer_precision)
    if precision.startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision.startswith("16"):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_trainable_dtype(model: nn.Module, expected: torch.dtype, trainer_precision: str) -> str:
    """Raise unless every trainable parameter is ``expected``; return a one-line summary of the layout.

    Run once training is set up (after any precision plugin or sharding touched the parameters).

    Raises:
        RuntimeError: a trainable parameter has another dtype (e.g. ``trainer.precision=bf16-true`` casts the
            whole model to bf16).
    """
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
