"""Episodes: running groups of episodes through the environment pool with the current policy (SPEC §2.1).

All active episodes advance together: one batched policy call per step for all of them, one parallel
environment step, one batched embedding call (memory keys and novelty) — never one call per episode.
The same runner serves training rollouts, in-training validation and evaluation (no second loop).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from src.data.prompts import HistoryItem, build_step_messages
from src.models.policy import Policy
from src.utils.distributed import all_reduce

log = logging.getLogger(__name__)


class EpisodeMemory(Protocol):
    """What the runner needs from the memory (implemented by ``src.callbacks.memory.MemoryCallback``)."""

    def state_text(self, instruction: str, observation: str) -> str: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...

    def retrieve(self, tasks: list[dict], keys: np.ndarray) -> list[list[str]]: ...

    def novelty_rewards(self, tasks: list[dict], keys: np.ndarray) -> np.ndarray: ...


@dataclass
class StepRecord:
    """One agent step = one training sample (SPEC §2.1).

    ``rollout_prompt_ids``: the prompt the policy sampled from (with tips in memory rollouts).
    ``update_prompt_ids``: the prompt used for the update; tips removed in ``off_policy`` iterations (SPEC §2.4),
    otherwise the same list. ``response_ids`` / ``sample_log_probs``: exactly what the policy generated and the
    log-probs it sampled them with. ``reward``: extrinsic reward (environment units); ``intrinsic``: novelty bonus.
    """

    observation: str
    rollout_prompt_ids: list[int]
    update_prompt_ids: list[int]
    response_ids: list[int]
    sample_log_probs: list[float]
    response_text: str
    action: str
    reward: float = 0.0
    intrinsic: float = 0.0
    valid_action: bool = True
    tips: list[str] = field(default_factory=list)
    key: np.ndarray | None = None
    history_shown: int = 0  # past steps the rollout prompt showed (after fitting it to the budget)


@dataclass
class Episode:
    """A finished episode. ``failed`` episodes (a crashed environment worker) have ``episode_return`` NaN and are
    excluded from their group's advantage statistics (SPEC §2.2)."""

    task: dict[str, Any]
    group: int
    instruction: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    score: float = 0.0
    max_score: float = 1.0
    success: bool = False
    failed: bool = False
    error: str | None = None
    final_observation: str = ""
    truncated: bool = False
    # the last rollout prompt's keys/values (RolloutConfig.keep_reflection_prefix): the reflection continues it
    reflection_prefix: Any = field(default=None, repr=False)

    def summary(self) -> dict[str, float]:
        """The per-episode numbers behind ``episode_metrics`` (small and picklable, for gathering over ranks)."""
        return {"failed": self.failed, "return": self.discounted_return(), "score": self.score,
                "success": self.success, "length": len(self.steps),
                "extrinsic_return": sum(s.reward for s in self.steps),
                "invalid_actions": sum(not s.valid_action for s in self.steps)}

    def discounted_return(self, gamma: float = 1.0) -> float:
        """R = Σ_t γ^t (r_t + r_int_t); NaN for a failed episode."""
        if self.failed:
            return math.nan
        return float(sum(gamma ** t * (s.reward + s.intrinsic) for t, s in enumerate(self.steps)))


@dataclass
class RolloutConfig:
    """How episodes are run. ``use_tips``: retrieve tips into the rollout prompts; ``strip_tips_for_update``: also
    render the tip-free update prompt (off-policy mode); ``history_length``: past steps shown in the prompt;
    ``keep_reflection_prefix``: store each finished episode's last prompt keys/values on the episode
    (``Episode.reflection_prefix``) so the reflection that continues that prompt does not recompute it."""

    temperature: float = 1.0
    max_response_tokens: int = 32
    history_length: int = 5
    history_obs_chars: int | None = None
    use_tips: bool = False
    strip_tips_for_update: bool = False
    tips_scope: str = "current"
    novelty: bool = False
    do_sample: bool = True
    keep_reflection_prefix: bool = False  # keep each episode's last prompt keys/values for its tip (write_tips)


def run_episodes(pool, policy: Policy, tasks: list[dict[str, Any]], groups: list[int], cfg: RolloutConfig,
                 memory: EpisodeMemory | None = None, max_steps: int | None = None) -> tuple[list[Episode], dict[str, float]]:
    """Run one episode per entry of ``tasks`` (episode i on pool worker i) to the end.

    Args:
        pool: an ``EnvPool`` with at least ``len(tasks)`` workers.
        policy: the current policy.
        tasks: task dicts accepted by the environment's ``reset``.
        groups: group id of each episode (episodes of the same task instance share one).
        cfg: see ``RolloutConfig``.
        memory: needed when ``cfg.use_tips`` or ``cfg.novelty``; when given, every step's state key is stored
            on the step so tips can be written afterwards.
        max_steps: only shown in the prompt (the environment enforces its own cap).

    Returns:
        (episodes, metrics) — metrics hold timings (s) and token counts.

    Raises:
        ValueError: ``use_tips``/``novelty`` without a memory, or more tasks than pool workers.
    """
    if (cfg.use_tips or cfg.novelty) and memory is None:
        raise ValueError("use_tips/novelty need a memory, got memory=None")
    if len(tasks) != len(groups):
        raise ValueError(f"{len(tasks)} tasks but {len(groups)} group ids")
    t0 = time.perf_counter()
    timers = {"generate_s": 0.0, "env_s": 0.0, "memory_s": 0.0}
    episodes = [Episode(task=t, group=g) for t, g in zip(tasks, groups)]
    histories: list[list[HistoryItem]] = [[] for _ in tasks]
    observations = [""] * len(tasks)
    infos: list[dict] = [{} for _ in tasks]
    tic = time.perf_counter()
    resets = pool.reset(list(enumerate(tasks)))
    timers["env_s"] += time.perf_counter() - tic
    active = []
    for i, (obs, info) in enumerate(resets):
        if "error" in info:
            episodes[i].failed, episodes[i].error = True, info["error"]
            continue
        observations[i], infos[i] = obs, info
        episodes[i].instruction = info.get("instruction", "")
        episodes[i].max_score = float(info.get("max_score", 1.0))
        active.append(i)
    keys = _embed_states(memory, episodes, observations, active, timers)
    generated_tokens = 0
    while _any_active(policy, active):
        tips: list[list[str]] = [[] for _ in active]
        if cfg.use_tips and active:
            tic = time.perf_counter()
            tips = memory.retrieve([tasks[i] for i in active], keys[active])
            timers["memory_s"] += time.perf_counter() - tic
        prompts, update_prompts, shown = [], [], []
        for j, i in enumerate(active):
            common = dict(system_prompt=pool.system_prompt, instruction=episodes[i].instruction, history=histories[i],
                          observation=observations[i], admissible_actions=infos[i].get("admissible_actions"),
                          history_length=cfg.history_length, history_obs_chars=cfg.history_obs_chars,
                          tips_scope=cfg.tips_scope,
                          step=len(episodes[i].steps), max_steps=max_steps)
            step_tips = fit_prompt(policy, common, tips[j] if cfg.use_tips else None)
            tips[j] = step_tips or []
            shown.append(min(common["history_length"], len(histories[i])) if common["history_length"] > 0 else 0)
            ids = policy.encode(build_step_messages(tips=step_tips, **common))
            prompts.append(ids)
            update_prompts.append(policy.encode(build_step_messages(tips=None, **common))
                                  if cfg.use_tips and cfg.strip_tips_for_update else ids)
        tic = time.perf_counter()
        keep = {"keep_prompt_kv": True} if cfg.keep_reflection_prefix else {}
        gen = policy.generate(prompts, max_new_tokens=cfg.max_response_tokens, temperature=cfg.temperature,
                              do_sample=cfg.do_sample, **keep)
        timers["generate_s"] += time.perf_counter() - tic
        generated_tokens += sum(len(r) for r in gen.response_ids)
        tic = time.perf_counter()
        results = pool.step([(i, gen.texts[j]) for j, i in enumerate(active)])
        timers["env_s"] += time.perf_counter() - tic
        still_active = []
        for j, i in enumerate(active):
            obs, reward, terminated, truncated, info = results[j]
            ep = episodes[i]
            if "error" in info:
                ep.failed, ep.error = True, info["error"]
                continue
            action = info.get("action", gen.texts[j])
            ep.steps.append(StepRecord(
                observation=observations[i], rollout_prompt_ids=prompts[j], update_prompt_ids=update_prompts[j],
                response_ids=gen.response_ids[j], sample_log_probs=gen.log_probs[j], response_text=gen.texts[j],
                action=action, reward=float(reward), valid_action=bool(info.get("valid_action", True)),
                tips=tips[j], key=None if keys is None else keys[i], history_shown=shown[j]))
            histories[i].append(HistoryItem(observations[i], action, tips[j]))
            observations[i], infos[i] = obs, info
            ep.score = float(info.get("score", ep.score))
            ep.success = bool(info.get("success", False))
            if terminated or truncated:
                ep.final_observation, ep.truncated = obs, bool(truncated and not terminated)
                if cfg.keep_reflection_prefix:
                    ep.reflection_prefix = gen.prompt_kv(j)
            else:
                still_active.append(i)
        # Keys of the states just reached: the next step's memory queries and this step's novelty bonus.
        keys = _embed_states(memory, episodes, observations, [i for i in active if not episodes[i].failed], timers, keys)
        if cfg.novelty:
            reached = [i for i in active if not episodes[i].failed]
            tic = time.perf_counter()
            bonus = memory.novelty_rewards([tasks[i] for i in reached], keys[reached]) if reached else []
            timers["memory_s"] += time.perf_counter() - tic
            for i, b in zip(reached, bonus):
                episodes[i].steps[-1].intrinsic = float(b)
        log.info("rollout step %d: %d/%d episodes still running (%.1f s, generate %.1f s, env %.1f s, memory %.1f s)",
                 max((len(e.steps) for e in episodes), default=0), len(still_active), len(episodes),
                 time.perf_counter() - t0,
                 timers["generate_s"], timers["env_s"], timers["memory_s"])
        active = still_active
    elapsed = time.perf_counter() - t0
    metrics = dict(timers, rollout_s=elapsed, generated_tokens=float(generated_tokens),
                   rollout_tokens_per_s=generated_tokens / max(timers["generate_s"], 1e-9))
    return episodes, metrics


def padding_sample(eos_token_id: int) -> dict[str, Any]:
    """A one-token throw-away sample: lets a rank with no data of its own join the other ranks' forward and
    backward passes under DDP/FSDP (its loss is scaled by 0 or its outputs discarded)."""
    return {"prompt_ids": [eos_token_id], "old_prompt_ids": [eos_token_id], "rollout_prompt_ids": [eos_token_id],
            "response_ids": [eos_token_id], "sample_log_probs": [0.0], "advantage": 0.0,
            "old_log_probs": torch.zeros(1), "ref_log_probs": torch.zeros(1)}


def _any_active(policy: Policy, active: list[int]) -> bool:
    """Whether to run another step. Under FSDP (``policy.synced``) a rank keeps joining the policy's forward
    passes, with nothing of its own to generate, until every rank's episodes are done."""
    if policy.synced:
        return all_reduce([float(len(active))], op="max")[0] > 0
    return bool(active)


def fit_prompt(policy: Policy, common: dict, tips: list[str] | None) -> list[str] | None:
    """Shrink the prompt until it fits ``policy.max_prompt_tokens``: oldest history first, then the lowest-ranked
    tips. ``common`` is updated in place (its ``history_length``); returns the tips that fit."""
    def length() -> int:
        return len(policy.encode(build_step_messages(tips=tips, **common), truncate=False))

    while length() > policy.max_prompt_tokens:
        if common["history_length"] > 0 and common["history"]:
            common["history_length"] = min(common["history_length"], len(common["history"])) - 1
        elif tips:
            tips = tips[:-1]
        else:
            break  # the current observation alone is too long: Policy.encode cuts it
    return tips


def _embed_states(memory, episodes, observations, indices, timers, keys=None):
    """Embed ``instruction + observation`` of the given episodes into rows of ``keys`` ([n_episodes, dim])."""
    if memory is None or not indices:
        return keys
    tic = time.perf_counter()
    vectors = memory.embed([memory.state_text(episodes[i].instruction, observations[i]) for i in indices])
    if keys is None:
        keys = np.zeros((len(episodes), vectors.shape[1]), dtype=np.float32)
    keys = keys.copy()
    keys[indices] = vectors
    timers["memory_s"] += time.perf_counter() - tic
    return keys


def episode_metrics(episodes: list[Episode] | list[dict], prefix: str = "") -> dict[str, float]:
    """Mean return, score (env units), success rate, episode length and invalid-action rate of finished episodes.

    Accepts episodes or their ``Episode.summary()`` dicts (e.g. gathered from all ranks).
    """
    rows = [e.summary() if isinstance(e, Episode) else e for e in episodes]
    done = [r for r in rows if not r["failed"]]
    out = {"episodes": float(len(rows)), "failed_episodes": float(len(rows) - len(done))}
    if done:
        steps = sum(r["length"] for r in done)
        out.update({
            "return": float(np.mean([r["return"] for r in done])),
            "extrinsic_return": float(np.mean([r["extrinsic_return"] for r in done])),
            "score": float(np.mean([r["score"] for r in done])),
            "success_rate": float(np.mean([r["success"] for r in done])),
            "episode_length": float(np.mean([r["length"] for r in done])),
            "invalid_action_rate": sum(r["invalid_actions"] for r in done) / steps if steps else 0.0,
        })
    return {f"{prefix}{k}": v for k, v in out.items()}
