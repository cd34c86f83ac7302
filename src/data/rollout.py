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

# What ``fit_prompt`` counts (summed over a rollout's prompts, logged as ``rollout/prompt_fit/<key>``).
PROMPT_CUT_KEYS = ("prompts_fitted", "admissible_actions_cut", "history_steps_cut", "tips_cut",
                   "observation_chars_cut")
HISTORY_ACTIONS = ("raw", "executed")


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
    log-probs it sampled them with. ``response_text``: the decoded response (the model's raw output);
    ``action``: the action the environment executed (after parsing / action correction). ``reward``: extrinsic
    reward (environment units); ``intrinsic``: novelty bonus.
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
    """A finished episode. An episode ``failed`` when its environment worker crashed or returned a non-finite
    reward (``error`` says which); it has return NaN, gives no samples, is excluded from its group's advantage
    statistics (SPEC §2.2) and is counted once, as ``failed_episodes``."""

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
                "intrinsic_return": sum(s.intrinsic for s in self.steps),
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
    ``history_action``: what the history shows as each past step's action, ``raw`` (the model's output, as the
    authors record it with action correction: ``record_original_action``) or ``executed`` (the action the
    environment ran, e.g. the corrected one). ``keep_reflection_prefix``: store each finished episode's last prompt
    keys/values on the episode (``Episode.reflection_prefix``) so the reflection that continues that prompt does
    not recompute it."""

    temperature: float = 1.0
    max_response_tokens: int = 32
    history_length: int = 5
    history_obs_chars: int | None = None
    use_tips: bool = False
    strip_tips_for_update: bool = False
    tips_scope: str = "current"
    novelty: bool = False
    do_sample: bool = True
    history_action: str = "raw"
    keep_reflection_prefix: bool = False  # keep each episode's last prompt keys/values for its tip (write_tips)

    def __post_init__(self) -> None:
        if self.history_action not in HISTORY_ACTIONS:
            raise ValueError(f"history_action must be one of {HISTORY_ACTIONS}, got {self.history_action!r}")


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
        (episodes, metrics) — metrics hold timings (s), token counts and what ``fit_prompt`` cut
        (``prompt_fit/<key>``, see ``PROMPT_CUT_KEYS``).

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
    prompt_cuts = dict.fromkeys(PROMPT_CUT_KEYS, 0.0)
    while _any_active(policy, active):
        tips: list[list[str]] = [[] for _ in active]
        if cfg.use_tips and active:
            tic = time.perf_counter()
            tips = memory.retrieve([tasks[i] for i in active], keys[active])
            timers["memory_s"] += time.perf_counter() - tic
        prompts, update_prompts, shown = [], [], []
        for j, i in enumerate(active):
            ids, update_ids, tips[j], history_shown = step_prompt(
                policy, cfg, pool.system_prompt, episodes[i].instruction, histories[i], observations[i],
                infos[i].get("admissible_actions"), len(episodes[i].steps), max_steps, tips[j], prompt_cuts)
            shown.append(history_shown)
            prompts.append(ids)
            update_prompts.append(update_ids)
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
            if "error" in info or not math.isfinite(reward):
                ep.failed = True
                ep.error = info.get("error", f"non-finite reward {reward!r} at step {len(ep.steps) + 1}")
                log.warning("episode %d (task %s) failed: %s", i, tasks[i], ep.error)
                continue
            action = info.get("action", gen.texts[j])
            ep.steps.append(StepRecord(
                observation=observations[i], rollout_prompt_ids=prompts[j], update_prompt_ids=update_prompts[j],
                response_ids=gen.response_ids[j], sample_log_probs=gen.log_probs[j], response_text=gen.texts[j],
                action=action, reward=float(reward), valid_action=bool(info.get("valid_action", True)),
                tips=tips[j], key=None if keys is None else keys[i], history_shown=shown[j]))
            past_action = gen.texts[j].strip() if cfg.history_action == "raw" else action
            histories[i].append(HistoryItem(observations[i], past_action, tips[j]))
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
                   rollout_tokens_per_s=generated_tokens / max(timers["generate_s"], 1e-9),
                   **{f"prompt_fit/{k}": v for k, v in prompt_cuts.items()})
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


def step_prompt(policy: Policy, cfg: RolloutConfig, system_prompt: str, instruction: str,
                history: list[HistoryItem], observation: str, admissible_actions: list[str] | None, step: int,
                max_steps: int | None, tips: list[str] | None = None,
                cuts: dict[str, float] | None = None) -> tuple[list[int], list[int], list[str], int]:
    """The prompt ids of one agent step, fitted to ``policy.max_prompt_tokens`` (SPEC §2.1).

    The one place a step's prompt is rendered: rollouts, validation and the imitation warm start
    (``src/warm_start.py``) all call it, so a demonstration's prompt is token for token the prompt RL samples from.

    Args:
        cfg: history length, past-observation cap, tips scope, ``use_tips`` / ``strip_tips_for_update``.
        history: past steps of the episode, oldest first; ``step``: how many there were (0-based index).
        tips: retrieved tips, shown only when ``cfg.use_tips``.
        cuts: accumulates what ``fit_prompt`` cut (see there).

    Returns:
        (rollout prompt ids, update prompt ids — tip-free when ``cfg.strip_tips_for_update``, else the same
        list —, the tips that fit, the number of past steps the prompt shows).
    """
    common = dict(system_prompt=system_prompt, instruction=instruction, history=history, observation=observation,
                  admissible_actions=admissible_actions, history_length=cfg.history_length,
                  history_obs_chars=cfg.history_obs_chars, tips_scope=cfg.tips_scope, step=step,
                  max_steps=max_steps)
    step_tips = fit_prompt(policy, common, tips if cfg.use_tips else None, cuts)
    ids = policy.encode(build_step_messages(tips=step_tips, **common))
    update_ids = (policy.encode(build_step_messages(tips=None, **common))
                  if cfg.use_tips and cfg.strip_tips_for_update else ids)
    shown = min(common["history_length"], len(history)) if common["history_length"] > 0 else 0
    return ids, update_ids, step_tips or [], shown


def fit_prompt(policy: Policy, common: dict, tips: list[str] | None,
               cuts: dict[str, float] | None = None) -> list[str] | None:
    """Fit a step prompt to ``policy.max_prompt_tokens`` before it is encoded, keeping what the agent needs most.

    The head (system prompt, task) and the current observation always stay. Over budget, the prompt is
    shortened in this order, each only as far as needed: the admissible-action list (to the evenly spaced
    subset that fits), the oldest history steps, the lowest-ranked tips; only if the head and the whole
    observation alone are too long is the observation's end cut (a warning, and a count). ``common`` (the
    keyword arguments of ``build_step_messages`` except ``tips``) is updated in place; returns the tips that
    fit. ``cuts``, when given, accumulates ``prompts_fitted``, ``admissible_actions_cut``,
    ``history_steps_cut``, ``tips_cut`` and ``observation_chars_cut``. Only a head longer than the budget is
    left to ``Policy.encode``'s left cut (counted in ``policy.num_prompts_truncated``).
    """
    def fits(shown_tips: list[str] | None, **changes) -> bool:
        messages = build_step_messages(tips=shown_tips, **{**common, **changes})
        return len(policy.encode(messages, truncate=False)) <= policy.max_prompt_tokens

    if fits(tips):
        return tips
    counts = {"prompts_fitted": 1}
    actions = common.get("admissible_actions") or []
    if actions:
        common["admissible_shown"] = _largest_fitting(lambda n: fits(tips, admissible_shown=n), len(actions) - 1)
        counts["admissible_actions_cut"] = len(actions) - common["admissible_shown"]
    shown = min(common["history_length"], len(common["history"])) if common["history_length"] > 0 else 0
    history_before = shown
    while shown > 0 and not fits(tips, history_length=shown):
        shown -= 1
    common["history_length"] = shown
    counts["history_steps_cut"] = history_before - shown
    tips_before = len(tips or [])
    while tips and not fits(tips):
        tips = tips[:-1]
    counts["tips_cut"] = tips_before - len(tips or [])
    if not fits(tips):
        observation = common["observation"]
        common["observation_chars"] = _largest_fitting(lambda c: fits(tips, observation_chars=c),
                                                       len(observation) - 1)
        counts["observation_chars_cut"] = len(observation) - common["observation_chars"]
        log.warning("prompt over %d tokens even without admissible actions, history and tips: the current "
                    "observation was cut by %d characters", policy.max_prompt_tokens,
                    counts["observation_chars_cut"])
    if cuts is not None:
        for key, value in counts.items():
            cuts[key] = cuts.get(key, 0.0) + float(value)
    return tips


def _largest_fitting(fits, high: int) -> int:
    """The largest n in 0..high with ``fits(n)`` (binary search; lengths grow with n); 0 when none fits."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


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
            "intrinsic_return": float(np.mean([r["intrinsic_return"] for r in done])),
            "score": float(np.mean([r["score"] for r in done])),
            "success_rate": float(np.mean([r["success"] for r in done])),
            "episode_length": float(np.mean([r["length"] for r in done])),
            "invalid_action_rate": sum(r["invalid_actions"] for r in done) / steps if steps else 0.0,
        })
    return {f"{prefix}{k}": v for k, v in out.items()}
