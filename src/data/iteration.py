"""One RL iteration, owned by one function (docs/method.md#one-iteration).

``run_iteration`` reads top to bottom in the paper's order: mode and tasks → play the groups → write the tips →
novelty bonus, returns and GRPO advantages → samples → old log-probs → mini-batches. Nothing here knows of a
Trainer, so an iteration runs the same inside Lightning (``RolloutDataModule``) and outside it (tests).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterator

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from src.data.minibatches import micro_batches
from src.data.rollout import Episode, episode_metrics, inference, play_groups
from src.data.rollout_config import DataConfig, RolloutConfig
from src.data.samples import MicroBatch, StepSample
from src.models.advantages import compute_grpo_advantages
from src.models.algorithm_config import AlgorithmConfig
from src.models.old_log_probs import score_samples
from src.utils.distributed import combine_over_ranks, gather_lists, gather_objects, rank_and_world
from src.utils.rng import MODE, REFLECTION, SAMPLING, TASKS, seed_torch, stream_seed
from src.utils.timing import timed

log = logging.getLogger(__name__)


@dataclass
class IterationSettings:
    """How an iteration is drawn, played and cut (the ``data`` and ``algorithm`` groups; ``RolloutDataModule`` lists
    each setting). ``rollout``: the training rollouts' ``RolloutConfig`` (temperature, limits, tips header and scope);
    the mode sets its tips fields and seed."""

    algorithm: AlgorithmConfig
    rollout: RolloutConfig
    data: DataConfig


@dataclass
class Collaborators:
    """What an iteration uses but does not own. ``reference``: the frozen KL reference (None: the policy with its
    LoRA adapters off, or no KL); ``precision``: the forward context of rollouts and scoring (the Trainer's)."""

    policy: Any
    pool: Any
    tasks: list[dict]
    reference: Any = None
    memory: Any = None
    precision: Callable[[], ContextManager] | None = None


def run_iteration(s: IterationSettings, c: Collaborators, iteration: int, global_step: int,
                  guard: SignalGuard) -> Iterator[MicroBatch]:
    """Play, score and cut training iteration ``iteration`` with the weights of optimizer step ``global_step``;
    yields its micro-batches (``src/data/minibatches.py``), the first carrying the iteration's ``rollout/*`` metrics.
    A collective under DDP/FSDP (every rank runs it with the same arguments but its own pool). Raises ValueError for
    a memory mode drawn without a memory, RuntimeError from ``SignalGuard.check``.
    """
    rank, world = rank_and_world()
    mode = draw_mode(s.data.seed, iteration, s.algorithm.memory_rollout_prob, s.algorithm.off_policy_prob)  # 1. draws
    if mode != "on_policy" and c.memory is None:
        raise ValueError(f"iteration {iteration} drew mode {mode!r} but memory is off; set "
                         "algorithm.memory_rollout_prob=0 or enable memory")
    tasks = draw_tasks(c.tasks, s.data.tasks_per_iteration, s.data.seed, iteration)
    truncated_before = c.policy.num_prompts_truncated
    with inference(c.policy, c.precision):
        episodes, metrics = play(s, c, tasks, mode, iteration, rank, world)         # 2. the groups
        tip_metrics = {} if c.memory is None else c.memory.write_tips(               # 3. tips written
            episodes, c.policy, c.pool.system_prompt, iteration=iteration,
            sample_seed=stream_seed(s.data.seed, iteration, REFLECTION))
        if c.memory is not None and c.memory.novelty_enabled:                       # 4. novelty bonus,
            c.memory.add_novelty_bonus(episodes)
        advantages, adv_metrics = group_advantages(episodes, s.algorithm, rank)    # returns, advantages
        samples, counts = make_samples(episodes, advantages, mode, s.algorithm)    # 5. samples
        with timed(metrics, "old_log_prob_s"):
            score_samples(samples, c.policy, c.reference, s.algorithm)              # 6. old (and ref) log-probs
    metrics["policy_prompts_truncated"] = float(c.policy.num_prompts_truncated - truncated_before)
    adv_metrics = {f"adv/{k}": v for k, v in {**adv_metrics, **counts}.items()}
    metrics = iteration_metrics(metrics, tip_metrics, adv_metrics, episodes, c.memory)
    guard.check(metrics, iteration)
    guard.warn_cut_replies(metrics.get("rollout/replies_cut_frac", 0.0), s.rollout.max_response_tokens)
    info = {"iteration": iteration, "mode": mode, "rollout_global_step": global_step}
    yield from micro_batches(samples, info, metrics, seed=s.data.seed, iteration=iteration,  # 7. mini-batches
                             ppo_epochs=s.data.ppo_epochs, num_mini_batches=s.data.num_mini_batches,
                             mini_batch_rows=s.data.mini_batch_rows, micro_batch_size=s.data.micro_batch_size,
                             micro_batch_tokens=s.data.micro_batch_tokens,
                             padding=lambda: StepSample.padding(c.policy.tokenizer.eos_token_id))


def draw_mode(seed: int, iteration: int, memory_rollout_prob: float, off_policy_prob: float) -> str:
    """The update mode of an iteration (docs/method.md#one-iteration, step 1): on_policy w.p. 1−p, else off_policy w.p.
    q, else with tips; seeded by (seed, iteration), so the same on every rank and after a resume."""
    rng = np.random.default_rng([seed, iteration, MODE])
    if rng.random() >= memory_rollout_prob:
        return "on_policy"
    return "off_policy" if rng.random() < off_policy_prob else "on_policy_with_tips"


def draw_tasks(tasks: list[dict], n: int, seed: int, iteration: int) -> list[dict]:
    """The iteration's ``n`` task instances, drawn for all ranks from (seed, iteration), with replacement only when
    there are fewer than ``n`` (task k of the draw is group k and runs on rank k mod world: ``play_groups``)."""
    rng = np.random.default_rng([seed, iteration, TASKS])
    picks = rng.choice(len(tasks), size=n, replace=len(tasks) < n)
    return [tasks[int(i)] for i in picks]


def play(s: IterationSettings, c: Collaborators, tasks: list[dict], mode: str, iteration: int, rank: int,
         world: int) -> tuple[list[Episode], dict[str, float]]:
    """This rank's episodes of the iteration: ``group_size`` per task (``play_groups``), retrieving tips in the memory
    modes, sampled from the iteration's stream. Returns the episodes and this rank's rollout counts."""
    seed_torch(s.data.seed, iteration, SAMPLING, rank)  # anything else that draws from torch's generator
    log.info("iteration %d (%s): rank %d of %d runs tasks %s", iteration, mode, rank, world,
             json.dumps(tasks[rank::world]))
    cfg = replace(s.rollout, use_tips=mode != "on_policy", strip_tips_for_update=mode == "off_policy",
                  strip_current_tips=s.algorithm.semantics == "paper",
                  sample_seed=stream_seed(s.data.seed, iteration, SAMPLING),
                  # the reflections written next continue each episode's last prompt without recomputing it
                  keep_reflection_prefix=c.memory is not None and c.memory.reuse_rollout_cache)
    return play_groups(c.pool, c.policy, tasks, s.data.group_size, cfg, c.memory, s.data.max_steps)


def group_advantages(episodes: list[Episode], algorithm: AlgorithmConfig,
                     rank: int) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's episodes' GRPO advantages ``[E]`` (float64, dimensionless) from their discounted returns, bonus
    included (not under ``algorithm.semantics=authors``: their bonus reaches the logged rewards only), normalised
    within each group over all ranks' episodes (a collective under DDP/FSDP), and the advantage metrics
    (``compute_grpo_advantages``; failed episodes are counted once, as ``rollout/failed_episodes``)."""
    gamma, bonus = algorithm.gamma, algorithm.semantics == "paper"  # the authors' advantage reads no bonus
    per_rank = gather_objects([(e.discounted_return(gamma, bonus=bonus), e.discounted_return(gamma, bonus=False),
                                e.group) for e in episodes])
    everyone = [row for rows in per_rank for row in rows]
    returns = torch.tensor([r for r, _, _ in everyone], dtype=torch.float64)
    extrinsic = torch.tensor([x for _, x, _ in everyone], dtype=torch.float64)
    group_index = torch.tensor([g for _, _, g in everyone], dtype=torch.long)
    advantages, metrics = compute_grpo_advantages(returns, group_index, algorithm.norm_adv_by_std,
                                                  extrinsic_returns=extrinsic, semantics=algorithm.semantics)
    metrics.pop("num_failed_episodes")
    start = sum(len(rows) for rows in per_rank[:rank])
    return advantages[start:start + len(episodes)], metrics


def make_samples(episodes: list[Episode], advantages: torch.Tensor, mode: str,
                 algorithm: AlgorithmConfig) -> tuple[list[StepSample], dict[str, float]]:
    """One sample per step of every valid episode, carrying its episode's advantage (docs/method.md#one-iteration,
    step 5): trained under the update prompt, π_old taken under the rollout prompt or, in ``off_policy`` with
    ``off_policy_old_log_prob: without_tips``, the update prompt. Returns the samples and the counts over all ranks
    (a collective); ``algorithm.skip_zero_advantage`` (DAPO-style) is opt-in because it rescales the loss."""
    old_with_tips = mode != "off_policy" or algorithm.off_policy_old_log_prob == "with_tips"
    samples, skipped, steps, signal_samples, signal_tokens = [], 0, 0, 0, 0
    for episode, advantage in zip(episodes, advantages.tolist()):
        if episode.failed:
            continue
        steps += len(episode.steps)
        if advantage != 0.0:
            signal_samples += len(episode.steps)
            signal_tokens += sum(len(s.response_ids) for s in episode.steps)
        if algorithm.skip_zero_advantage and advantage == 0.0:
            skipped += len(episode.steps)
            continue
        samples += [StepSample(rollout_prompt_ids=step.rollout_prompt_ids, update_prompt_ids=step.update_prompt_ids,
                               old_prompt_ids=step.rollout_prompt_ids if old_with_tips else step.update_prompt_ids,
                               response_ids=step.response_ids, rollout_log_probs=step.rollout_log_probs,
                               advantage=advantage, key=(episode.id, t)) for t, step in enumerate(episode.steps)]
    counts = combine_over_ranks(dict(skipped_zero_adv_samples=float(skipped), samples=float(len(samples)),
                                     steps=float(steps), signal_samples=float(signal_samples),
                                     signal_tokens=float(signal_tokens)))
    return samples, counts


def iteration_metrics(metrics: dict[str, float], tip_metrics: dict[str, float], adv_metrics: dict[str, float],
                      episodes: list[Episode], memory) -> dict[str, float]:
    """The iteration's ``rollout/*`` metrics over all ranks: this rank's timings and counts combined (durations: the
    slowest rank's; counts: summed), rates derived from them, then the tip, advantage, episode and memory metrics."""
    metrics = combine_over_ranks(metrics)
    replies, cut = metrics.pop("replies"), metrics.pop("replies_cut")
    if replies:
        metrics["replies_cut_frac"] = cut / replies
    metrics["rollout_tokens_per_s"] = metrics["generated_tokens"] / max(metrics["generate_s"], 1e-9)
    if metrics.get("prompt_tokens"):  # the share of prompt ids the rollout did not compute (shared prefixes)
        metrics["prompt_shared_frac"] = 1.0 - metrics["prompt_tokens_computed"] / metrics["prompt_tokens"]
    metrics.update(tip_metrics)
    metrics.update(adv_metrics)
    metrics.update(episode_metrics(gather_lists([e.summary() for e in episodes])))
    if memory is not None:
        metrics.update(memory.pop_metrics())
    return {f"rollout/{k}": v for k, v in metrics.items()}


NO_SIGNAL_METRICS = ("rollout/episodes", "rollout/failed_episodes", "rollout/return", "rollout/score",
                     "rollout/adv/samples", "rollout/adv/zero_var_group_frac", "rollout/adv/skipped_zero_adv_samples")


def no_signal_cause(steps: float, signal_samples: float, signal_tokens: float) -> str | None:
    """Why an iteration has no policy-gradient signal (counts over all ranks), or None when it has one."""
    if steps == 0:
        return "no samples: every episode failed or ended before its first step"
    if signal_samples == 0:
        return "all advantages are zero: in every group all episodes had the same return"
    if signal_tokens == 0:
        return "zero trainable tokens: the steps with a non-zero advantage have empty responses"
    return None


class SignalGuard:
    """Watches whether iterations teach anything. ``no_signal_iterations`` (consecutive iterations without a
    policy-gradient signal, the same on every rank: it counts over all ranks) is resume state, saved by
    ``RolloutDataModule``."""

    def __init__(self, algorithm: AlgorithmConfig):
        self.algorithm = algorithm
        self.no_signal_iterations = 0
        self.warned_bonus_only = False  # once per process
        self.warned_cut_replies = False  # once per run

    def check(self, metrics: dict[str, float], iteration: int) -> None:
        """Warn once when the novelty bonus alone ranks groups (``warn_bonus_only``), then the no-signal guard: warn
        (or raise, with ``algorithm.fail_on_no_signal``) after ``algorithm.no_signal_patience`` consecutive iterations
        without a signal on any rank. A signal is a response token of a step whose advantage is non-zero (KL and
        entropy alone teach nothing about the reward): without one, the run trains nothing while looking healthy.
        Raises RuntimeError with ``fail_on_no_signal`` once the patience is used up.
        """
        self.warn_bonus_only(metrics["rollout/adv/bonus_only_group_frac"])
        steps, signal, tokens = (metrics[f"rollout/adv/{k}"] for k in ("steps", "signal_samples", "signal_tokens"))
        cause = no_signal_cause(steps, signal, tokens)
        self.no_signal_iterations = self.no_signal_iterations + 1 if cause else 0
        if cause is None or self.no_signal_iterations < self.algorithm.no_signal_patience:
            return
        shown = {k: metrics[k] for k in NO_SIGNAL_METRICS if k in metrics}
        message = (f"no trainable signal for {self.no_signal_iterations} consecutive iterations (iterations "
                   f"{iteration - self.no_signal_iterations + 1}..{iteration}; this one over all ranks: {steps:g} "
                   f"steps, {signal:g} with a non-zero advantage, {tokens:g} of their tokens): {cause}. "
                   f"Metrics over all ranks: {shown}")
        if self.algorithm.fail_on_no_signal:
            raise RuntimeError(message + " (algorithm.fail_on_no_signal=true)")
        rank_zero_warn(message + " Set algorithm.fail_on_no_signal=true to stop such runs.")

    def warn_bonus_only(self, frac: float) -> None:
        """Warn (once per process) when a share ``frac`` of the groups, whose episodes earned the same environment
        return, are ranked by the novelty bonus alone under std-normalised advantages: a bonus difference of 1e-3 then
        weighs as much as a success (the message says when that matters; docs/results/coin-dfs)."""
        if frac == 0.0 or not self.algorithm.norm_adv_by_std or self.warned_bonus_only:
            return
        self.warned_bonus_only = True
        rank_zero_warn(f"{frac:.0%} of this iteration's groups have advantages set by the novelty bonus alone "
                       f"(equal environment returns; rollout/adv/bonus_only_group_frac): divided by the group std, "
                       f"the bonus's small differences get full-size advantages. In groups that all failed that is "
                       f"exploration; in groups that all succeeded it rewards what the bonus favours, such as longer "
                       f"episodes (algorithm.norm_adv_by_std=false, Dr.GRPO, keeps them at the bonus's scale). "
                       f"Warned once per process.")

    def warn_cut_replies(self, frac: float, cap: int) -> None:
        """Warn (once per run) when most of an iteration's replies (a share ``frac`` over all ranks) hit the token cap:
        a cut reply reaches the environment as a partial action."""
        if frac <= 0.5 or self.warned_cut_replies:
            return
        self.warned_cut_replies = True
        rank_zero_warn(f"{frac:.0%} of this iteration's replies were cut at data.max_response_tokens={cap} (no end of "
                       f"reply within it; rollout/replies_cut_frac): the environment gets partial actions. Raise "
                       f"data.max_response_tokens. Warned once per run.")
