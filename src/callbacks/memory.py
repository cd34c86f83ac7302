"""The EMPO² memory as a Lightning callback: tip memory, novelty memory and embedder (docs/method.md#memory).

The rollout (``src/data/iteration.py``) calls it with explicit arguments; checkpoints are its one persistence path.
Under DDP/FSDP every rank adds all ranks' tips and visits in the same order, so every rank holds the same memory.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.utilities import rank_zero_warn

from src.callbacks.tip_tables import log_tip_tables
from src.data.reflection_prompt import reflection_prompt_ids
from src.envs.base import is_action_reply
from src.memory.embedder import Embedder
from src.memory.novelty import NoveltyMemory
from src.memory.settings import PARTITIONS, MemoryConfig
from src.memory.tip_entry import format_entry
from src.memory.tip_memory import TipMemory
from src.utils.distributed import all_reduce, check_same_on_every_rank, combine_over_ranks, gather_lists
from src.utils.logging import task_text
from src.utils.rng import row_seeds
from src.utils.timing import timed

log = logging.getLogger(__name__)


def task_name(task: dict[str, Any]) -> str:
    """The task a task dict belongs to (shared by its variations): the novelty store's key, the ``task`` partition."""
    return str(task.get("task_name", task.get("task_id", "task")))


def partition_key(task: dict[str, Any], partition: str) -> str:
    """The tip-memory partition of a task dict: ``global``, the task name or ``<task name>/<variation>``
    (docs/method.md#memory). Raises ValueError for an unknown ``partition``, or ``variation`` for a task without
    one (its variations would silently share a partition)."""
    if partition == "global":
        return "global"
    if partition == "task":
        return task_name(task)
    if partition != "variation":
        raise ValueError(f"memory partition must be one of {PARTITIONS}, got {partition!r}")
    variation = task.get("variation")
    if variation is None:
        raise ValueError(f"task {task!r} has no 'variation' for memory.partition=variation (an environment's task "
                         "dicts name their variation: docs/extending.md)")
    return f"{task_name(task)}/{variation}"


def state_text(key: str, instruction: str, observation: str) -> str:
    """The memory key text of a state under ``memory.key``: instruction + latest observation, or the observation
    alone (every key of a partition shares its instruction, which flattens their cosines; docs/method.md#memory)."""
    return observation if key == "observation" else f"{instruction}\n{observation}"


class MemoryCallback(L.Callback):
    """Self-generated tips memory plus intrinsic novelty reward.

    ``settings``: the ``memory`` group (``MemoryConfig``, or its keys as keyword arguments). ``reuse_rollout_cache``
    keeps each episode's last prompt keys/values so that the reflection continues that prompt (memory until the tips
    are written: ~46 KB per prompt token for SmolLM2 in fp32, ~57 KB for Qwen2.5-7B in bf16).
    Raises ValueError for an unknown partition or an embedder that does not match the tip memory.
    """

    def __init__(self, embedder: Embedder, tip_memory: TipMemory, settings: MemoryConfig | None = None, **values):
        super().__init__()
        s = self.settings = settings or MemoryConfig.from_dict(values)
        if embedder.dim != tip_memory.dim or embedder.name != tip_memory.embedder_name:
            raise ValueError(f"embedder ({embedder.name}, {embedder.dim}-d) does not match the tip memory "
                             f"({tip_memory.embedder_name}, {tip_memory.dim}-d)")
        self.embedder, self.tips, self.key, self.partition = embedder, tip_memory, s.key, s.partition
        self.tips_enabled = s.write_tips  # False: the novelty bonus alone (algorithm=grpo_novelty)
        self.tips_scope, self.tip_max_tokens, self.reuse_rollout_cache = (s.tips_scope, s.tip_max_tokens,
                                                                         s.reuse_rollout_cache)
        self.novelty_enabled = s.novelty.enabled
        self.novelty = NoveltyMemory(embedder.dim, s.novelty)
        self._warned_action_tips = False
        self.last_reflections: list[dict[str, Any]] = []
        self._record_tables = False  # set in setup(): a fit logs each iteration's tip tables
        self._retrieved: list[dict[str, Any]] = []  # this rank's rows of the retrieved-tips table (training only)
        self._written: list[dict[str, Any]] = []  # all ranks' rows of the written-tips table (training only)
        self._write_s = 0.0  # the last write_tips' seconds (slowest rank's), logged by on_train_batch_start
        self.bare_command = None  # the environment's bare-command pattern (is_action_reply), set by use_environment
        self._reset_counters()

    @classmethod
    def from_config(cls, memory: Any, semantics: str = "paper") -> MemoryCallback:
        """The memory of the ``memory`` group with the retrieval rule of ``algorithm.semantics``; raises
        ValueError for a bad setting."""
        settings = MemoryConfig.from_dict(memory)
        embedder = Embedder(settings.embedder)
        return cls(embedder, TipMemory(embedder.dim, embedder.name, settings.tip_memory, semantics), settings)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._record_tables = stage == "fit"

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        """On an iteration's first micro-batch (the one carrying its rollout metrics), log its tip tables (a
        collective under DDP/FSDP) and ``rollout/tip_tables_s`` / ``rollout/tip_write_s`` at the iteration's step."""
        if not getattr(batch, "metrics", None) or not (self._record_tables and self.tips_enabled):
            return
        tic = time.perf_counter()
        retrieved, self._retrieved = gather_lists(self._retrieved), []
        tables = {name: [{"iteration": batch.iteration, "mode": batch.mode, **row} for row in rows]
                  for name, rows in (("written", self._written), ("retrieved", retrieved))}
        self._written = []
        log_tip_tables(trainer, batch.iteration, tables)
        seconds = all_reduce([time.perf_counter() - tic], op="max")[0]
        metrics = {"rollout/tip_tables_s": seconds, "rollout/tip_write_s": self._write_s + seconds}
        self._write_s = 0.0
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=batch.iteration)
        pl_module.log_dict(metrics, logger=False, on_step=True, on_epoch=False, batch_size=1)

    def use_environment(self, env_cfg: dict[str, Any]) -> None:
        """Read what a bare command looks like in this environment (for ``tip_action_frac``)."""
        from src.envs.base import environment_class

        self.bare_command = environment_class(env_cfg).bare_command

    def state_text(self, instruction: str, observation: str) -> str:
        return state_text(self.key, instruction, observation)

    def embed(self, texts: list[str]) -> np.ndarray:
        with timed(self.counters, "embed_s"):
            return self.embedder.encode(texts)

    def partition_key(self, task: dict[str, Any]) -> str:
        return partition_key(task, self.partition)

    def retrieve(self, tasks: list[dict], keys: np.ndarray, where: list[tuple[int, int]] | None = None
                 ) -> list[list[str]]:
        """Tip contents for each (task, key [dim]) pair (``TipMemory.retrieve``). ``where``: the (episode id, step)
        of each query; in training each tip shown is then a row of the iteration's retrieved-tips table."""
        partitions = [self.partition_key(t) for t in tasks]
        with timed(self.counters, "retrieve_s"):
            hits = self.tips.retrieve(partitions, keys, with_similarity=True)
        self.counters["queries"] += len(hits)
        self.counters["hits"] += sum(1 for h in hits if h)
        self.counters["tips_shown"] += sum(len(h) for h in hits)
        if where is not None and self._record_tables:
            for task, partition, (episode, step), hit in zip(tasks, partitions, where, hits):
                self._retrieved += [{"partition": partition, "task": task_text(task), "episode": int(episode),
                                     "step": int(step), "rank": rank, "similarity": round(cos, 4), "tip_score": e.score,
                                     "tip_iteration": e.iteration, "tip_step": e.step, "content": e.content}
                                    for rank, (e, cos) in enumerate(hit)]
        return [[e.content for e, _ in h] for h in hits]

    def add_novelty_bonus(self, episodes) -> None:
        """Set each step's intrinsic reward, the count-based bonus of the state it reached
        (docs/method.md#count-based-novelty-bonus). All ranks' states of step t are scored together against the
        store as it was before step t, so it is the same on every rank whatever the order (a collective)."""
        with timed(self.counters, "novelty_s"):
            local = [(e.id, t, task_name(e.task), s.reached_key) for e in episodes for t, s in enumerate(e.steps)
                     if s.reached_key is not None]
            by_step: dict[int, list] = {}
            for row in gather_lists(local):
                by_step.setdefault(row[1], []).append(row)
            bonus = {}
            for t in sorted(by_step):
                rows = by_step[t]
                rewards = self.novelty.rewards([r[2] for r in rows], np.stack([r[3] for r in rows]))
                bonus.update({(r[0], t): float(b) for r, b in zip(rows, rewards)})
        for e in episodes:
            for t, s in enumerate(e.steps):
                s.intrinsic = bonus.get((e.id, t), 0.0)

    def write_tips(self, episodes, policy, system_prompt: str, sample_seed: int | None = None,
                   iteration: int | None = None) -> dict[str, float]:
        """Ask the policy for one reflection per finished episode (one batched call) and store one entry per step
        (docs/method.md#memory, "Entries"), keyed by the step's state embedding; releases the kept keys/values.

        Returns timings (s), token counts, ``tips_cut_frac`` and ``tip_action_frac``, over all ranks (counts summed,
        durations the slowest rank's): a collective, every rank adding every rank's entries in rank order.
        """
        if not self.tips_enabled:  # memory.write_tips=false: no reflection, nothing stored
            for e in episodes:
                e.reflection_prefix = None
            return {}
        tic = time.perf_counter()
        done = [e for e in episodes if not e.failed and e.steps and e.steps[0].key is not None]
        prompts, prefixes, shortened = [], [], 0
        for e in done:
            ids, prefix, n = self.reflection_prompt(policy, system_prompt, e)
            prompts.append(ids)
            prefixes.append(prefix)
            shortened += n
        for e in episodes:
            e.reflection_prefix = None
        timers: dict[str, float] = {}
        with timed(timers, "tip_generate_s"):
            cached = {"prefix_kv": prefixes} if any(p is not None for p in prefixes) else {}
            if sample_seed is not None:
                cached["seeds"] = [row_seeds(sample_seed, [e.id], 0)[0] for e in done]
            gen = policy.generate(prompts, max_new_tokens=self.tip_max_tokens, **cached)
        reflections = [" ".join(t.split()) for t in gen.texts]  # one line each: an entry is one line
        self.last_reflections = [{"task": e.task, "instruction": e.instruction, "score": e.score, "tip": tip}
                                 for e, tip in zip(done, reflections)]
        action_frac = self._check_reflections(reflections)
        batches = []
        for episode, tip in zip(done, reflections):
            tip = tip or "No reflection."
            contents = [format_entry(tip, s.action, episode.score, episode.max_score) for s in episode.steps]
            keys = np.stack([s.key for s in episode.steps]).astype(np.float32)
            partition = self.partition_key(episode.task)
            rows = [{"partition": partition, "task": task_text(episode.task), "episode": episode.id,
                     "episode_score": episode.score, "max_score": episode.max_score, "step": k, "action": s.action,
                     "tip": tip, "content": c} for k, (s, c) in enumerate(zip(episode.steps, contents))]
            batches.append((partition, keys, contents, [episode.score] * len(contents), list(range(len(contents))),
                            rows))
        written, table = 0, []
        for partition, keys, contents, scores, steps, rows in gather_lists(batches):
            stored = self.tips.add_rows(partition, keys, contents, scores, steps, iteration=iteration)
            written += len(stored)
            table += [rows[i] for i in stored]  # a repeated line (same tip, action and score) is stored once
        self.counters["tips_written"] += written
        if self._record_tables:
            self._written += table
        local = {**timers, "tip_write_s": time.perf_counter() - tic,
                 "tip_tokens": float(sum(len(r) for r in gen.response_ids)),
                 "reflections": float(len(done)), "tips_cut": float(sum(gen.truncated)),
                 "tip_prompt_tokens": float(sum(len(p) for p in prompts)),
                 "tip_prompt_cached_tokens": float(sum(p.length for p in prefixes if p is not None)),
                 "tip_prompts_continued": float(sum(p is not None for p in prefixes)),
                 "tip_observations_shortened": float(shortened)}
        combined = combine_over_ranks(local)
        self._write_s = combined.pop("tip_write_s")  # the memory's own metric (on_train_batch_start logs it)
        reflections, cut = combined.pop("reflections"), combined.pop("tips_cut")
        if reflections:  # the share that hit memory.tip_max_tokens
            combined["tips_cut_frac"] = cut / reflections
        return {"tips_written": float(written), **combined, **action_frac}

    def _check_reflections(self, texts: list[str]) -> dict[str, float]:
        """``{"tip_action_frac": share of all ranks' replies that are actions}`` ({} for none). A policy fine-tuned on
        actions only (e.g. the imitation warm start) answers the reflection prompt with an action, which carries no
        advice; warned about once above 1/2. A collective under DDP/FSDP."""
        actions = [t for t in texts if is_action_reply(t, self.bare_command)]
        n_actions, n_texts = all_reduce([float(len(actions)), float(len(texts))])
        if not n_texts:
            return {}
        frac = n_actions / n_texts
        if frac > 0.5 and not self._warned_action_tips:
            self._warned_action_tips = True
            example = f" (e.g. '{actions[0][:80]}')" if actions else ""
            rank_zero_warn(f"{frac:.0%} of the {n_texts:g} reflections just written are actions, not advice"
                           f"{example}: the tips will carry no information. "
                           "The policy answers the reflection prompt as an action step, as after an imitation warm "
                           "start trained on actions only; rollout/tip_action_frac tracks it.")
        return {"tip_action_frac": frac}

    @staticmethod
    def reflection_prompt(policy, system_prompt: str, episode) -> tuple[list[int], Any, int]:
        """(prompt ids, kept keys/values of their first ids or None, observations shortened) of the reflection on
        ``episode``'s trajectory; it continues the last rollout prompt when its keys/values were kept."""
        last, prefix = episode.steps[-1], episode.reflection_prefix
        usable = prefix is not None and prefix.length == len(last.rollout_prompt_ids)
        ids, continued, shortened = reflection_prompt_ids(policy, system_prompt, episode, continue_last=usable)
        return ids, prefix if continued else None, shortened

    def _reset_counters(self) -> None:
        self.counters = {"queries": 0, "hits": 0, "tips_shown": 0, "tips_written": 0, "embed_s": 0.0,
                         "retrieve_s": 0.0, "novelty_s": 0.0}

    def pop_metrics(self) -> dict[str, float]:
        """Memory size, retrieval hit rate, tips shown/written since the last call: over all ranks' queries (a
        collective under DDP/FSDP; the memory itself is the same on every rank)."""
        c = combine_over_ranks({k: v for k, v in self.counters.items() if k != "tips_written"})
        out = {"memory/size": float(len(self.tips)), "memory/partitions": float(len(self.tips.sizes())),
               "memory/novel_states": float(len(self.novelty)),
               "memory/novelty_visits": float(sum(sum(c) for c in self.novelty.visits().values())),
               "memory/tips_written": float(self.counters["tips_written"]), "memory/embed_s": float(c["embed_s"]),
               "memory/retrieve_s": float(c["retrieve_s"]), "memory/novelty_s": float(c["novelty_s"])}
        if c["queries"]:
            out["memory/hit_rate"] = c["hits"] / c["queries"]
            out["memory/tips_per_query"] = c["tips_shown"] / c["queries"]
        self._reset_counters()
        return out

    def state_dict(self) -> dict[str, Any]:
        """The tips and the novelty store, checked to be the same on every rank first (a collective)."""
        state = {"tips": self.tips.state_dict(), "novelty": self.novelty.state_dict()}
        check_same_on_every_rank(memory_digest_parts(state))
        return {**state, "key": self.key}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tips and the novelty store; raises ValueError for a memory keyed by another ``memory.key``."""
        saved = state_dict.get("key", "instruction_observation")  # older checkpoints: the only key there was
        if saved != self.key:
            raise ValueError(f"this memory was stored with memory.key={saved!r}, the run uses memory.key="
                             f"{self.key!r}: its keys would not match the queries; set memory.key={saved}")
        self.tips.load_state_dict(state_dict["tips"])
        self.novelty.load_state_dict(state_dict["novelty"])
        log.info("Restored memory: %d tips in %d partitions", len(self.tips), len(self.tips.sizes()))


def memory_digest_parts(state: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of a memory state that must agree across ranks: tip entries (not their wall-clock write time) and
    keys per partition, novelty states and counts per task."""
    import torch

    def raw(t) -> bytes:
        return torch.as_tensor(t).contiguous().numpy().tobytes()

    tips = state["tips"]["partitions"]
    novelty = state["novelty"]
    entries = repr([(name, [{k: v for k, v in e.items() if k != "created_at"} for e in tips[name]["entries"]])
                    for name in sorted(tips)]).encode()
    return {"tip entries": entries,
            "tip keys": b"".join(raw(tips[name]["keys"]) for name in sorted(tips)),
            "novelty states": b"".join(k.encode() + raw(novelty["states"][k]) for k in sorted(novelty["states"])),
            "novelty counts": b"".join(k.encode() + raw(novelty["counts"][k]) for k in sorted(novelty["counts"]))}
