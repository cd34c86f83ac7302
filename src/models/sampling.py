"""What sampling may read, how a step draws (``Sampler``), and the random streams of seeded rows. The trainer scores
every token with ``log_softmax(logits / T)`` over the full vocabulary, so tokens are drawn from exactly that: a
checkpoint's ``generation_config`` (Qwen2.5-7B-Instruct's ``top_k: 20``, ``top_p: 0.8``, ...) is ignored, with
a warning (``dropped_generation_defaults``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig

NEUTRAL_GENERATION_KEYS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                                     "use_cache", "output_attentions", "output_hidden_states",
                                     "transformers_version", "_from_model_config"})


def dropped_generation_defaults(generation_config: GenerationConfig | None) -> dict[str, Any]:
    """The checkpoint's generation settings that differ from transformers' defaults, token ids and bookkeeping aside."""
    if generation_config is None:
        return {}
    defaults = GenerationConfig._get_default_generation_params()
    return {k: v for k, v in sorted(generation_config.to_diff_dict().items())
            if k not in NEUTRAL_GENERATION_KEYS and v != defaults.get(k)}


def int64(c: int) -> int:
    """``c`` modulo 2**64 as a signed 64-bit value (torch's int64 arithmetic wraps the same way)."""
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: Tensor, k: int) -> Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical: torch's >> on int64 keeps the sign


# splitmix64 (Steele, Lea and Flood 2014): the increment ("gamma") and the two multipliers of Vigna's reference
# implementation; _SEED and _STEP are further odd 64-bit constants that place each (seed, step) pair's counters.
_GAMMA, _MIX1, _MIX2, _SEED, _STEP = (int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                                          0xD1B54A32D192ED03, 0xAEF17502108EF2D9))


def splitmix64(x: Tensor) -> Tensor:
    """splitmix64's output function of the int64 states ``x`` (element-wise, int64, the bits of the uint64 result)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def counter_exponentials(seeds: Tensor, step: int | Tensor, size: int) -> Tensor:
    """``[B, size]`` float64 draws of Exp(1), entry (i, k) a function of (``seeds[i]``, ``step``, k) alone: the k-th
    output of splitmix64 from the state ``seeds[i] * _SEED + step * _STEP``, its top 53 bits as u in (0, 1), then -log
    u (seed 0, step 0: splitmix64's reference sequence). Counter-based, so a batch is a few element-wise kernels
    (per-row ``torch.Generator`` calls are slow on a GPU: docs/performance.md). ``seeds``: ``[B]`` int64; ``step``: an
    int or a 0-d / ``[1]`` int64 tensor (what a captured CUDA graph reads; the same draws)."""
    index = torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device)
    offset = step * _STEP if isinstance(step, Tensor) else int64(step * _STEP)
    x = splitmix64(seeds[:, None] * _SEED + (index * _GAMMA + offset))
    return -torch.log((_shift_right(x, 11).double() + 0.5) * 2.0 ** -53)


class RowStreams:
    """Each row's stream for the exponential race ``argmax(logits / T - log E)``, ``E ~ Exp(1)`` (token k with
    probability ``softmax(logits / T)[k]``): ``counter_exponentials`` on CUDA, else a ``torch.Generator`` per row (the
    counter's int64 arithmetic is slow on a CPU; MPS has no float64). The two draw different tokens for the same seeds.
    Raises ValueError for a temperature <= 0."""

    def __init__(self, seeds: list[int], temperature: float, device: torch.device | str = "cpu",
                 counter: bool | None = None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature, self.device = temperature, torch.device(device)
        self.counter = self.device.type == "cuda" if counter is None else counter
        if self.counter:
            self.seeds = torch.tensor([int64(int(s)) for s in seeds], dtype=torch.int64, device=device)
        else:
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def draw(self, logits: Tensor, rows: Tensor, step: int) -> Tensor:
        """``[n]`` tokens of the rows ``rows`` (indices among the seeds) at ``step`` from ``logits`` ``[n, V]``."""
        if self.counter:
            log_race = counter_exponentials(self.seeds[rows.to(self.seeds.device)], step, logits.shape[-1]).log_()
        else:
            log_race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            for out, row in zip(log_race, rows.tolist()):
                out.exponential_(generator=self.generators[row])
            log_race.log_()
        return (logits.float() / self.temperature - log_race.float()).argmax(dim=-1)


@dataclass
class Sampler:
    """How one ``generate`` call draws: from each row's ``streams``, torch's global generator (``do_sample`` without
    streams), or greedily."""

    temperature: float
    do_sample: bool = True
    streams: RowStreams | None = None

    def pick(self, logits: Tensor, rows: Tensor, step: int | Tensor) -> tuple[Tensor, Tensor]:
        """The ``[n]`` tokens drawn from ``logits`` ``[n, V]`` (float32) for ``rows`` at ``step``, and their log-probs
        under ``log_softmax(logits / temperature)``."""
        log_softmax = torch.log_softmax(logits / self.temperature, dim=-1)
        if self.streams is not None:
            chosen = self.streams.draw(logits, rows, step)
        elif self.do_sample:
            chosen = torch.multinomial(torch.softmax(logits / self.temperature, dim=-1), num_samples=1).squeeze(1)
        else:
            chosen = logits.argmax(dim=-1)
        return chosen, log_softmax.gather(-1, chosen[:, None]).squeeze(-1)
