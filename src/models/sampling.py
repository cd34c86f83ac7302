"""Sampling exactly from ``softmax(logits / T)`` with the sampled tokens' log-probs, in bounded memory.

The trainer scores every sampled token with ``log_softmax(logits / T)`` over the full vocabulary (old and
behaviour log-probs of the clipped loss, docs/method.md#one-iteration), so the tokens must be drawn from that same
distribution. A checkpoint's ``generation_config`` may carry defaults that change it (Qwen2.5-7B-Instruct ships
``repetition_penalty: 1.05``, ``top_k: 20``, ``top_p: 0.8``; others ``min_p``, ``no_repeat_ngram_size``,
``bad_words_ids``, ...), and transformers fills every field a call leaves unset from it, so passing a fresh
``GenerationConfig`` is not enough: :func:`checkpoint_generation_defaults_off` also hides the checkpoint's config for
the duration of a call.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessor

log = logging.getLogger(__name__)

# generation_config fields that do not change which token is drawn (token ids and bookkeeping).
NEUTRAL_GENERATION_KEYS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                                     "use_cache", "output_attentions", "output_hidden_states",
                                     "transformers_version", "_from_model_config"})


def sampling_config(max_new_tokens: int, temperature: float, do_sample: bool, eos_token_ids: list[int],
                    pad_token_id: int) -> GenerationConfig:
    """The whole generation config of a policy call: plain sampling at ``temperature`` (or greedy), nothing else.

    ``top_k=0`` and ``top_p=1.0`` are explicit because transformers' global defaults (top_k 50) fill unset fields.
    """
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample,
                            temperature=temperature if do_sample else None, top_k=0, top_p=1.0,
                            eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id,
                            return_dict_in_generate=True)


def dropped_generation_defaults(generation_config: GenerationConfig | None) -> dict[str, Any]:
    """The checkpoint's generation settings that policy sampling ignores: every field that differs from
    transformers' defaults, except token ids and bookkeeping (:data:`NEUTRAL_GENERATION_KEYS`)."""
    if generation_config is None:
        return {}
    defaults = GenerationConfig._get_default_generation_params()
    return {k: v for k, v in sorted(generation_config.to_diff_dict().items())
            if k not in NEUTRAL_GENERATION_KEYS and v != defaults.get(k)}


def _holders(model: nn.Module) -> list[nn.Module]:
    # A PEFT model copies its own generation_config into the base model at every generate call.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [m for m in dict.fromkeys([model, base]) if hasattr(m, "generation_config")]


@contextlib.contextmanager
def checkpoint_generation_defaults_off(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model.generation_config`` (and a PEFT base model's) is an empty ``GenerationConfig``,
    so ``generate`` uses only the config passed to it; the checkpoint's config is restored afterwards."""
    holders = _holders(model)
    saved = [m.generation_config for m in holders]
    try:
        for m in holders:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, config in zip(holders, saved):
            m.generation_config = config


class SampledTokenLogProbs(LogitsProcessor):
    """Log-probs of the sampled tokens under ``softmax(logits / temperature)``, gathered step by step.

    ``generate`` calls it at every step with that step's raw logits ``[B, V]`` (no other processor runs before it
    under :func:`sampling_config`); the token drawn at step t is the last column of ``input_ids`` at step t + 1,
    and the last step's token is passed to :meth:`finish`. Only one step's ``[B, V]`` float32 log-softmax is
    held at a time: extra memory O(B·V), independent of the response length (``output_logits=True`` held
    ``[B, T, V]`` float32: ~5 GB for 16 × 512 tokens of a 152k vocabulary).
    """

    def __init__(self, temperature: float):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self._previous: Tensor | None = None
        self._steps: list[Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._gather(input_ids[:, -1])
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _gather(self, tokens: Tensor) -> None:
        if self._previous is not None:
            index = tokens.to(self._previous.device).unsqueeze(-1)
            self._steps.append(self._previous.gather(-1, index).squeeze(-1))
            self._previous = None

    def finish(self, sequences: Tensor) -> Tensor:
        """``[B, T]`` float32 log-probs of the generated ``sequences`` ``[B, T]`` (prompt columns removed).

        Raises:
            RuntimeError: the number of recorded steps is not T (generation skipped or repeated this processor).
        """
        if sequences.shape[1]:
            self._gather(sequences[:, -1])
        if len(self._steps) != sequences.shape[1]:
            raise RuntimeError(f"recorded log-probs for {len(self._steps)} steps but {sequences.shape[1]} tokens "
                               f"were generated")
        if not self._steps:
            return torch.zeros(sequences.shape, dtype=torch.float32)
        return torch.stack(self._steps, dim=1)


def _int64(c: int) -> int:
    """``c`` modulo 2**64 as a signed 64-bit value (torch's int64 arithmetic wraps the same way)."""
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: Tensor, k: int) -> Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical: torch's >> on int64 keeps the sign


# splitmix64 (Steele, Lea and Flood 2014): the increment ("gamma") and the two multipliers of Vigna's reference
# implementation; _SEED and _STEP are further odd 64-bit constants that place each (seed, step) pair's counters.
_GAMMA, _MIX1, _MIX2, _SEED, _STEP = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                                          0xD1B54A32D192ED03, 0xAEF17502108EF2D9))


def splitmix64(x: Tensor) -> Tensor:
    """splitmix64's output function of the int64 states ``x`` (element-wise, int64, the bits of the uint64 result)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def counter_exponentials(seeds: Tensor, step: int, size: int) -> Tensor:
    """``[B, size]`` float64 draws of Exp(1), entry (i, k) a function of (``seeds[i]``, ``step``, k) alone: the k-th
    output of splitmix64 started from the state ``seeds[i] * _SEED + step * _STEP``, its top 53 bits as a uniform u in
    (0, 1), then -log u. With seed 0 at step 0 this is splitmix64's reference sequence from state 0.

    A counter-based generator: a row's draws depend on nothing else in the batch and no generator state is kept, so
    a whole batch is a few element-wise kernels (on a GPU, per-row ``torch.Generator`` calls made every decoding step
    of a 7B model 2.3-4x slower: docs/performance.md). ``seeds``: ``[B]`` int64 on the target device.
    """
    index = torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device)
    x = splitmix64(seeds[:, None] * _SEED + (index * _GAMMA + _int64(step * _STEP)))
    return -torch.log((_shift_right(x, 11).double() + 0.5) * 2.0 ** -53)


class SeededRowSampler(LogitsProcessor):
    """Draws each row's next token from ``softmax(logits / temperature)`` with the row's own random stream.

    ``generate`` samples all rows of a batch from torch's global generator, so a row's tokens depend on the other
    rows of its batch and on the generator's history: the same episode run in another batch (on another rank, or
    with other episodes beside it) would draw other tokens. Here row i draws from a stream seeded with ``seeds[i]`` by
    the exponential race (Gumbel-max): ``argmax(logits / T - log E)`` with one ``E ~ Exp(1)`` per vocabulary entry
    and step, which picks token k with probability ``softmax(logits / T)[k]``. The scores returned are 0 at the drawn
    token and -inf elsewhere, so ``generate`` run greedily (``do_sample=False``, no warper) takes that token. It must
    come after the log-prob recorder, which needs the raw logits.

    The stream: on a CUDA GPU the counter-based :func:`counter_exponentials` (``counter=True``); elsewhere one
    ``torch.Generator`` per row (``counter=False``: on a CPU the counter's int64 arithmetic is ~10x slower than
    torch's sampler, and Apple's MPS has no float64). The two give different tokens for the same seeds, each the
    same in every batch.
    """

    def __init__(self, seeds: list[int], temperature: float, device: torch.device | str = "cpu",
                 counter: bool | None = None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.counter = torch.device(device).type == "cuda" if counter is None else counter
        if self.counter:
            self.seeds = torch.tensor([_int64(int(s)) for s in seeds], dtype=torch.int64, device=device)
            self.step = 0
        else:
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = len(self.seeds) if self.counter else len(self.generators)
        if scores.shape[0] != rows:
            raise RuntimeError(f"{rows} row seeds for a batch of {scores.shape[0]} rows")
        if self.counter:
            log_race = counter_exponentials(self.seeds, self.step, scores.shape[-1]).log_().float()
            self.step += 1
        else:
            log_race = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
            for row, g in zip(log_race, self.generators):
                row.exponential_(generator=g)
            log_race.log_()
        tokens = (scores.float() / self.temperature - log_race).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, -torch.inf).scatter_(-1, tokens, 0.0)
