"""Logits → per-token log-probs and entropies (``Policy.log_probs``), in float32 (float64 stays float64) over
slices of about ``chunk_tokens`` tokens, each checkpointed under autograd: neither pass holds a float32 ``[B, T, V]``.
The temperature divides the upcast slice (bf16 logits / T in bf16 would round once more)."""
from __future__ import annotations

from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from src.models.core_algos import check_shape


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _upcast(logits: Tensor, temperature: float) -> Tensor:
    z = logits.to(_compute_dtype(logits.dtype))
    return z / temperature if temperature != 1.0 else z


def _token_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    z = _upcast(logits, temperature)
    return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    z = _upcast(logits, temperature)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    return lse.squeeze(-1) - (p * z).sum(dim=-1)


def _chunked(fn, logits: Tensor, labels: Tensor | None, chunk_tokens: int) -> Tensor:
    """``fn`` over ``[b, t, V]`` views of at most ~``chunk_tokens`` tokens, reassembled ``[B, T]``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    B, T, _ = logits.shape
    out_dtype = _compute_dtype(logits.dtype)
    if B == 0 or T == 0:
        return logits.new_zeros((B, T), dtype=out_dtype)
    t_step = min(T, chunk_tokens)
    b_step = max(1, chunk_tokens // T)
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    row_blocks = []
    for b0 in range(0, B, b_step):
        parts = []
        for t0 in range(0, T, t_step):
            args = [logits[b0:b0 + b_step, t0:t0 + t_step]]
            if labels is not None:
                args.append(labels[b0:b0 + b_step, t0:t0 + t_step])
            parts.append(checkpoint(fn, *args, use_reentrant=False) if use_ckpt else fn(*args))
        row_blocks.append(torch.cat(parts, dim=1))
    return torch.cat(row_blocks, dim=0)


def log_probs_from_logits(logits: Tensor, labels: Tensor, chunk_tokens: int = 1024, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)[..., label]`` of each label, as ``logit[label] - logsumexp(logits)``:
    ``[B, T]`` float32 (float64 for float64 logits) nats from ``[B, T, V]`` logits, differentiable; ``chunk_tokens``
    costs ~``chunk_tokens · V · 4`` bytes of temporaries. Raises ValueError for bad shapes, labels not integer ids
    in ``[0, V)`` (any valid id on padding) or ``temperature <= 0``."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    check_shape("labels", labels, logits.shape[:2])
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    V = logits.shape[-1]
    if labels.numel() and bool(((labels < 0) | (labels >= V)).any()):
        raise ValueError(f"labels must lie in [0, {V}); got min {int(labels.min())}, max {int(labels.max())}")
    _check_temperature(temperature)
    return _chunked(partial(_token_log_probs, temperature=temperature), logits, labels.long(), chunk_tokens)


def entropy_from_logits(logits: Tensor, chunk_tokens: int = 1024, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` at each position, ``logsumexp(z) - Σ softmax(z)·z``:
    ``[B, T]`` from ``[B, T, V]`` (finite), as :func:`log_probs_from_logits`; differentiable. Raises ValueError."""
    _check_temperature(temperature)
    return _chunked(partial(_token_entropy, temperature=temperature), logits, None, chunk_tokens)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
