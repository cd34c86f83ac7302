"""Episodes: running groups of episodes through the environment pool with the current policy
(docs/method.md#one-iteration, step 2), for training, validation and evaluation alike.

All active episodes advance together: per step one batched policy call, one parallel environment step and one
batched embedding call (memory keys), never one call per episode.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import numpy as np
import torch

from src.data.prompts import HistoryItem
from src.data.rollout_config import RolloutConfig
from src.data.step_prompt import PROMPT_CUT_KEYS, StepPrompt, step_prompt
from src.models.policy import MIN_SHARED_PREFIX, Policy
from src.models.prompt_cache import SharedPrefixes
from src.utils.distributed import all_reduce, gather_lists, rank_and_world
from src.utils.rng import row_seeds
from src.utils.timing import timed

log = logging.getLogger(__name__)


class EpisodeMemory(Protocol):
    """What the runner needs from the memory (implemented by ``src.callbacks.memory.MemoryCallback``)."""

    def state_text(self, instruction: str, observation: str) -> str: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...

    def retrieve(self, tasks: list[dict], keys: np.ndarray,
                 where: list[tuple[int, int]] | None = None) -> list[list[str]]: ...


@dataclass
class StepRecord:
    """One agent step = one training sample (docs/method.md#one-iteration, step 5).

    ``rollout_prompt_ids``: the prompt sampled from (with tips in memory rollouts); ``update_prompt_ids``: the one
    trained on (tips removed in ``off_policy``, else the same list). ``reward`` is in environment units. ``key`` /
    ``reached_key``: embeddings of the state the step was taken in / reached (the novelty bonus is scored on it).
    """

    observation: str
    rollout_prompt_ids: list[int]
    update_prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    response_text: str
    action: str
    reward: float = 0.0
    intrinsic: float = 0.0
    valid_action: bool = True
    tips: list[str] = field(default_factory=list)
    key: np.ndarray | None = None
    reached_key: np.ndarray | None = None
    history_shown: int = 0  # past steps the rollout prompt showed (after fitting it to the budget)


@dataclass
class Episode:
    """A finished episode. It ``failed`` (``error`` says why) when its worker crashed or returned a non-finite
    reward: return NaN, no samples, out of its group's advantage statistics, counted once as ``failed_episodes``.
    ``id``: its number among all ranks' episodes of the call (seeds its sampling: ``RolloutConfig.sample_seed``).
    """

    task: dict[str, Any]
    group: int
    id: int = 0
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

    def discounted_return(self, gamma: float = 1.0, bonus: bool = True) -> float:
        """R = Σ_t γ^t (r_t + r_int_t) (``bonus=False``: Σ_t γ^t r_t, the environment's part); NaN for a failed
        episode."""
        if self.failed:
            return math.nan
        return float(sum(gamma ** t * (s.reward + (s.intrinsic if bonus else 0.0)) for t, s in enumerate(self.steps)))


def run_episodes(pool, policy: Policy, tasks: list[dict[str, Any]], groups: list[int], cfg: RolloutConfig,
                 memory: EpisodeMemory | None = None, max_steps: int | None = None,
                 episode_ids: list[int] | None = None) -> tuple[list[Episode], dict[str, float]]:
    """Run one episode per entry of ``tasks`` (episode i on pool worker i) to the end.

    ``max_steps`` is only shown in the prompt (the environment enforces its cap). With ``cfg.sample_seed`` episode e
    draws its tokens at step t from ``row_seeds(sample_seed, [e], t)``. Returns (episodes, metrics): timings (s),
    token counts, ``replies`` / ``replies_cut`` and what ``fit_prompt`` cut (``prompt_fit/<key>``).
    Raises ValueError for ``use_tips`` without a memory, or more tasks than pool workers.
    """
    if cfg.use_tips and memory is None:
        raise ValueError("use_tips needs a memory, got memory=None")
    if len(tasks) != len(groups):
        raise ValueError(f"{len(tasks)} tasks but {len(groups)} group ids")
    ids = list(range(len(tasks))) if episode_ids is None else [int(e) for e in episode_ids]
    if len(ids) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks but {len(ids)} episode ids")
    t0 = time.perf_counter()
    run = _Rollout(pool, policy, cfg, memory, max_steps,
                   [Episode(task=t, group=g, id=e) for t, g, e in zip(tasks, groups, ids)])
    # the weights stay fixed for the whole rollout: a prompt prefix computed at one step serves the later ones
    shared = SharedPrefixes(MIN_SHARED_PREFIX) if cfg.share_prompt_prefix else None
    active = run.reset()
    while _any_active(policy, active):
        prompts = run.step_prompts(active)
        with timed(run.timers, "generate_s"):
            keep = {"keep_prompt_kv": True} if cfg.keep_reflection_prefix else {}
            if cfg.sample_seed is not None:
                keep["seeds"] = [row_seeds(cfg.sample_seed, [run.episodes[i].id], len(run.episodes[i].steps))[0]
                                 for i in active]
            gen = policy.generate([p.rollout_ids for p in prompts], max_new_tokens=cfg.max_response_tokens,
                                  temperature=cfg.temperature, do_sample=cfg.do_sample, shared=shared, **keep)
        run.generated_tokens += sum(len(r) for r in gen.response_ids)
        run.replies, run.replies_cut = run.replies + len(gen.truncated), run.replies_cut + sum(gen.truncated)
        with timed(run.timers, "env_s"):
            results = pool.step([(i, gen.texts[j]) for j, i in enumerate(active)])
        still_active = [i for j, i in enumerate(active) if run.record_step(i, j, prompts[j], gen, results[j])]
        # Keys of the states just reached: the next step's memory queries and this step's novelty bonus.
        reached = [i for i in active if not run.episodes[i].failed]
        run.embed_states(reached)
        run.record_reached_keys(reached)
        timers, elapsed = run.timers, time.perf_counter() - t0
        step = max((len(e.steps) for e in run.episodes), default=0)
        # episodes end at the step cap at the latest, so the steps left bound the time left
        left = f", at most ~{elapsed / step * (max_steps - step):.0f} s left" if max_steps and still_active else ""
        log.info("rollout step %d%s: %d/%d episodes still running (%.1f s, generate %.1f s, env %.1f s, memory "
                 "%.1f s%s)", step, f"/{max_steps}" if max_steps else "", len(still_active), len(run.episodes), elapsed,
                 timers["generate_s"], timers["env_s"], timers["memory_s"], left)
        active = still_active
    elapsed = time.perf_counter() - t0
    metrics = dict(run.timers, rollout_s=elapsed, generated_tokens=float(run.generated_tokens),
                   replies=float(run.replies), replies_cut=float(run.replies_cut),
                   rollout_tokens_per_s=run.generated_tokens / max(run.timers["generate_s"], 1e-9),
                   **({} if shared is None else {"prompt_tokens": float(shared.prompt_tokens),
                                                 "prompt_tokens_computed": float(shared.computed_tokens)}),
                   **{f"prompt_fit/{k}": v for k, v in run.prompt_cuts.items()})
    return run.episodes, metrics


class _Rollout:
    """The state of a batch of running episodes, and the parts of one step of ``run_episodes``."""

    def __init__(self, pool, policy: Policy, cfg: RolloutConfig, memory: EpisodeMemory | None,
                 max_steps: int | None, episodes: list[Episode]):
        self.pool, self.policy, self.cfg, self.memory, self.max_steps = pool, policy, cfg, memory, max_steps
        self.episodes = episodes
        self.histories: list[list[HistoryItem]] = [[] for _ in episodes]
        self.observations = [""] * len(episodes)
        self.infos: list[dict] = [{} for _ in episodes]
        self.keys: np.ndarray | None = None  # [n_episodes, dim] state embeddings, with a memory
        self.timers = {"generate_s": 0.0, "env_s": 0.0, "memory_s": 0.0}
        self.prompt_cuts = dict.fromkeys(PROMPT_CUT_KEYS, 0.0)
        self.generated_tokens = self.replies = self.replies_cut = 0

    def reset(self) -> list[int]:
        """Reset every episode's environment; returns the indices of the episodes that started."""
        with timed(self.timers, "env_s"):
            resets = self.pool.reset(list(enumerate(e.task for e in self.episodes)))
        active = []
        for i, (obs, info) in enumerate(resets):
            episode = self.episodes[i]
            if "error" in info:
                episode.failed, episode.error = True, info["error"]
                log_failure(episode)
                continue
            self.observations[i], self.infos[i] = obs, info
            episode.instruction = info.get("instruction", "")
            episode.max_score = float(info.get("max_score", 1.0))
            active.append(i)
        self.embed_states(active)
        return active

    def step_prompts(self, active: list[int]) -> list[StepPrompt]:
        """The step's prompts of the active episodes: tips retrieved for the current states (memory rollouts),
        each prompt fitted to the budget, and the tip-stripped update prompt (``cfg.strip_tips_for_update``)."""
        tips: list[list[str]] = [[] for _ in active]
        if self.cfg.use_tips and active:
            with timed(self.timers, "memory_s"):
                tips = self.memory.retrieve([self.episodes[i].task for i in active], self.keys[active],
                                            where=[(self.episodes[i].id, len(self.episodes[i].steps)) for i in active])
        return [step_prompt(self.policy, self.cfg, self.pool.system_prompt, self.episodes[i].instruction,
                            self.histories[i], self.observations[i], self.infos[i].get("admissible_actions"),
                            len(self.episodes[i].steps), self.max_steps, tips[j], self.prompt_cuts)
                for j, i in enumerate(active)]

    def record_step(self, i: int, j: int, prompt: StepPrompt, gen, result: tuple) -> bool:
        """Record episode ``i``'s step (row ``j`` of the generation, ``result`` of its environment step); returns
        whether the episode goes on. A worker error or a non-finite reward fails the episode."""
        obs, reward, terminated, truncated, info = result
        ep = self.episodes[i]
        if "error" in info or not math.isfinite(reward):
            ep.failed = True
            ep.error = info.get("error", f"non-finite reward {reward!r} at step {len(ep.steps) + 1}")
            log_failure(ep)
            return False
        action = info.get("action", gen.texts[j])
        ep.steps.append(StepRecord(
            observation=self.observations[i], rollout_prompt_ids=prompt.rollout_ids,
            update_prompt_ids=prompt.update_ids, response_ids=gen.response_ids[j],
            rollout_log_probs=gen.log_probs[j], response_text=gen.texts[j], action=action, reward=float(reward),
            valid_action=bool(info.get("valid_action", True)), tips=prompt.tips,
            key=None if self.keys is None else self.keys[i], history_shown=prompt.history_shown))
        past_action = gen.texts[j].strip() if self.cfg.history_action == "raw" else action
        self.histories[i].append(HistoryItem(self.observations[i], past_action, prompt.tips))
        self.observations[i], self.infos[i] = obs, info
        ep.score = float(info.get("score", ep.score))
        ep.success = bool(info.get("success", False))
        if not (terminated or truncated):
            return True
        ep.final_observation, ep.truncated = obs, bool(truncated and not terminated)
        if self.cfg.keep_reflection_prefix:
            ep.reflection_prefix = gen.prompt_kv(j)
        return False

    def embed_states(self, indices: list[int]) -> None:
        """Embed ``instruction + observation`` of the given episodes into their rows of ``keys`` (with a memory)."""
        if self.memory is None or not indices:
            return
        with timed(self.timers, "memory_s"):
            memory = self.memory
            vectors = memory.embed([memory.state_text(self.episodes[i].instruction, self.observations[i])
                                    for i in indices])
            keys = (np.zeros((len(self.episodes), vectors.shape[1]), dtype=np.float32) if self.keys is None
                    else self.keys.copy())  # a copy: the recorded steps keep their rows
            keys[indices] = vectors
            self.keys = keys

    def record_reached_keys(self, reached: list[int]) -> None:
        """Store the key of the state each episode just reached on its last step (the novelty bonus's input)."""
        if self.keys is not None:
            for i in reached:
                self.episodes[i].steps[-1].reached_key = self.keys[i]


_FAILURE_KINDS: set[str] = set()


def log_failure(episode: Episode) -> None:
    """Warn of a failed episode once per kind of failure in this process (the error's last line, e.g. ``ValueError:
    ...``); later ones of the same kind go to DEBUG. ``rollout/failed_episodes`` counts them all."""
    last = next((line.strip() for line in reversed(str(episode.error).splitlines()) if line.strip()), "?")
    kind = re.sub(r"\bworker \d+", "worker", last)  # the same failure on another worker is the same kind
    level = logging.DEBUG if kind in _FAILURE_KINDS else logging.WARNING
    _FAILURE_KINDS.add(kind)
    log.log(level, "episode %d (task %s) failed: %s%s", episode.id, episode.task, episode.error,
            "" if level == logging.DEBUG else " (warned once per kind; rollout/failed_episodes counts them)")


def _any_active(policy: Policy, active: list[int]) -> bool:
    """Whether to run another step. Under FSDP (``policy.synced``) a rank keeps joining the policy's forward
    passes, with nothing of its own to generate, until every rank's episodes are done."""
    if policy.synced:
        return all_reduce([float(len(active))], op="max")[0] > 0
    return bool(active)


def log_episodes(episodes: list[Episode], what: str) -> None:
    """One INFO line per episode: ``<what> <task>: score, success, executed actions`` (held-out evaluations)."""
    for ep in episodes:
        log.info("%s %s: score %g, success %s, actions %s", what, ep.task, ep.score, ep.success,
                 [s.action for s in ep.steps])


def episode_metrics(episodes: list[Episode] | list[dict], prefix: str = "") -> dict[str, float]:
    """Mean return, score (env units), success rate, episode length and invalid-action rate of finished episodes
    (``Episode`` objects or their ``summary()`` dicts, e.g. gathered from all ranks)."""
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


def play_groups(pool, policy, tasks: list[dict], episodes_per_task: int, cfg: RolloutConfig, memory=None,
                max_steps: int | None = None) -> tuple[list[Episode], dict[str, float]]:
    """Play ``episodes_per_task`` episodes of each of ``tasks`` (the list of all ranks): task k is group k and runs
    on rank k mod world, its episodes numbered k·n + j on whichever rank runs it, so one process and N ranks play
    the same episodes (each episode's tokens are seeded by its number). Returns this rank's episodes (task-major)
    and ``run_episodes``' timings and counts."""
    rank, world = rank_and_world()
    mine = range(rank, len(tasks), world)
    episode_tasks = [tasks[k] for k in mine for _ in range(episodes_per_task)]
    groups = [k for k in mine for _ in range(episodes_per_task)]
    episode_ids = [k * episodes_per_task + j for k in mine for j in range(episodes_per_task)]
    return run_episodes(pool, policy, episode_tasks, groups, cfg, memory, max_steps, episode_ids=episode_ids)


@contextlib.contextmanager
def inference(policy: Policy, precision: Callable[[], ContextManager] | None = None):
    """How a policy plays and scores outside the update: eval mode (restored after), no autograd, and ``precision``
    (the Trainer's forward context)."""
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), (precision or contextlib.nullcontext)():
            yield
    finally:
        policy.train(was_training)


def evaluate(pool, policy: Policy, tasks: list[dict], episodes_per_task: int, cfg: RolloutConfig,
             max_steps: int | None, memory=None, return_episodes: bool = False,
             precision: Callable[[], ContextManager] | None = None):
    """Run ``episodes_per_task`` episodes on each task (this rank's shard) with ``cfg`` under ``inference``; without
    ``memory`` and ``cfg.use_tips``, the paper's protocol (docs/evaluation.md#evaluating-a-policy). Returns episode
    metrics and the rollout time; with ``return_episodes`` the pair ``(metrics, episodes)``, episodes task-major."""
    with inference(policy, precision):
        episodes, timing = play_groups(pool, policy, tasks, episodes_per_task, cfg, memory, max_steps)
    # every rank summarises all ranks' episodes, so the numbers (and the logged keys) agree everywhere
    metrics = episode_metrics(gather_lists([e.summary() for e in episodes]))
    metrics["rollout_s"] = all_reduce([timing["rollout_s"]], op="max")[0]
    return (metrics, episodes) if return_episodes else metrics
