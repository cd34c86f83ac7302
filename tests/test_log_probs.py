"""Known-answer tests for src/models/log_probs.py: per-token log-probs and entropies from logits, sliced and
checkpointed, against the naive float32 log-softmax."""
from __future__ import annotations

import math

import pytest
import torch

from src.models.log_probs import entropy_from_logits, log_probs_from_logits

F64 = torch.float64


def _naive_lp(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits):
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def test_logits_helpers_uniform_known_answer():
    # zero logits over V = 4: p = 1/4 everywhere -> log p = -ln 4, entropy = ln 4
    logits, labels = torch.zeros(2, 3, 4), torch.tensor([[0, 1, 2], [3, 0, 1]])
    torch.testing.assert_close(log_probs_from_logits(logits, labels), torch.full((2, 3), -math.log(4)))
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(4)))


@pytest.mark.parametrize("chunk_tokens", [1, 4, 16, 1024])  # within-row chunks, multi-row chunks, one chunk
def test_logits_helpers_match_naive_with_grad(chunk_tokens):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 8, 11, generator=g) * 3
    labels = torch.randint(0, 11, (3, 7), generator=g)
    w = torch.randn(3, 7, generator=g)
    for fn, naive, args in [(log_probs_from_logits, _naive_lp, (labels,)), (entropy_from_logits, _naive_entropy, ())]:
        x1, x2 = base.clone().requires_grad_(), base.clone().requires_grad_()
        # logits[:, :-1] is a non-contiguous view, as in a causal-LM shift
        out = fn(x1[:, :-1], *args, chunk_tokens=chunk_tokens)
        ref = naive(x2[:, :-1], *args)
        assert out.dtype == torch.float32 and out.shape == (3, 7)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_logits_helpers_bf16_and_no_grad():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 13, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 13, (2, 5), generator=g)
    with torch.no_grad():
        out = log_probs_from_logits(logits, labels, chunk_tokens=3)
        ent = entropy_from_logits(logits, chunk_tokens=3)
    assert out.dtype == torch.float32 and ent.dtype == torch.float32
    # same bf16 values upcast: float32 arithmetic on both sides
    torch.testing.assert_close(out, _naive_lp(logits, labels), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, _naive_entropy(logits), rtol=1e-5, atol=1e-5)
    # against a bf16 log_softmax: bf16 rounding tolerance
    naive_bf16 = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    torch.testing.assert_close(out, naive_bf16, rtol=2e-2, atol=5e-2)
    # gradients flow into bf16 logits
    x = logits.clone().requires_grad_()
    log_probs_from_logits(x, labels, chunk_tokens=3).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16 and x.grad.abs().sum() > 0


def test_logits_helpers_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels, chunk_tokens=2), (x,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_tokens=2), (x,))


def test_logits_helpers_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        log_probs_from_logits(torch.zeros(1, 2, 4), torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="integer"):
        log_probs_from_logits(torch.zeros(1, 2, 4), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        entropy_from_logits(torch.zeros(2, 4))


def test_log_probs_do_not_save_full_fp32_logits_for_backward():
    # Bytes saved for backward in tensors other than views of the logits themselves: the checkpointed
    # slices keep only such views (no new memory); the naive path keeps a float32 [B, T, V] copy.
    logits = torch.randn(4, 64, 512).bfloat16().requires_grad_()
    labels = torch.randint(0, 512, (4, 64))
    full_fp32_bytes = logits.numel() * 4
    logits_storage = logits.untyped_storage().data_ptr()

    def saved_bytes(fn):
        total = 0

        def pack(x):
            nonlocal total
            if x.untyped_storage().data_ptr() != logits_storage:
                total += x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = fn()
        out.sum().backward()
        return total

    assert saved_bytes(lambda: _naive_lp(logits, labels)) >= full_fp32_bytes
    assert saved_bytes(lambda: log_probs_from_logits(logits, labels, chunk_tokens=64)) < full_fp32_bytes / 8
    assert saved_bytes(lambda: entropy_from_logits(logits, chunk_tokens=64)) < full_fp32_bytes / 8


def test_temperature_is_applied_after_the_fp32_upcast():
    """bf16 logits (autocast) are upcast before dividing by T: no extra bf16 rounding of logits / T."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 3, 50) * 5).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 3))
    z = logits.float() / 0.7
    expected = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(log_probs_from_logits(logits, labels, temperature=0.7), expected)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(entropy_from_logits(logits, temperature=0.7), -(p * p.log()).sum(-1), atol=1e-4,
                               rtol=1e-4)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        log_probs_from_logits(logits, labels, temperature=0)
