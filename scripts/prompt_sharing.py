"""How many prompt tokens the shared-prefix computation saves at paper shapes, from real WebShop step prompts.

    python scripts/prompt_sharing.py                       # experiment=webshop_paper: 16 goals x 8 episodes
    python scripts/prompt_sharing.py --tasks 32 --actors random expert

The prompts are the project's own (``step_prompt`` with the experiment's history length, action format and prompt
budget, rendered by the embedded SmolLM2 tokenizer; Qwen2.5's is not on an offline machine, and both use the same
ChatML layout), over real WebShop episodes of the training goals, ``group_size`` episodes per goal. The actions come
from a stand-in for the policy, since a 7B policy cannot sample 1,500-token prompts on a CPU:

- ``random``: uniform over the admissible actions; a group's episodes part after their first step (a lower bound);
- ``noisy``: the scripted expert, each action replaced by a random admissible one with probability ``--epsilon``;
- ``expert``: the scripted expert: all episodes of a goal take the same path (an upper bound).

Counted as the code counts it: the rollout generates each step's batch (every active episode) with one
``SharedPrefixes`` for the whole rollout (``src/models/prompt_cache.py``); the old/ref scoring and the update run in
chunks of ``data.micro_batch_size`` rows taken in prompt order (``src/data/minibatches.py``), each chunk's common
prefix once where that saves enough (``Policy.prefix_to_share``, counted on the prompts). Per phase: prompt tokens,
tokens computed, saved fraction.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))


def episode_prompts(env, policy, cfg, task: dict, actor: str, seed: int, epsilon: float, max_steps: int):
    """The step prompts (``StepPrompt``) of one episode of ``task``."""
    from src.data.prompts import HistoryItem
    from src.data.step_prompt import step_prompt
    from src.envs.webshop.baselines import ExpertPolicy, RandomPolicy

    rng, rand, expert = random.Random(seed), RandomPolicy(seed), ExpertPolicy(env)
    obs, info = env.reset(task)
    expert.reset()
    history, prompts, done = [], [], False
    while not done:
        prompt = step_prompt(policy, cfg, env.system_prompt, info.get("instruction", ""), history, obs,
                             info.get("admissible_actions"), len(history), max_steps)
        prompts.append(prompt)
        expert_reply = expert.act(obs, info)  # always asked, so the expert keeps its own state
        reply = rand.act(obs, info) if actor == "random" or (actor == "noisy" and rng.random() < epsilon) \
            else expert_reply
        next_obs, _, terminated, truncated, next_info = env.step(reply)
        history.append(HistoryItem(obs, next_info.get("action", reply)))
        obs, info, done = next_obs, next_info, terminated or truncated
    return prompts


def chunked_saving(prompt_ids: list[list[int]], policy, chunk: int) -> int:
    """Ids not computed when rows in prompt order run in chunks of ``chunk``, each chunk's common prefix once (where
    ``Policy.prefix_to_share`` computes it apart; the replies, short beside these prompts, are left out)."""
    rows, saved = sorted(prompt_ids), 0
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        saved += (len(part) - 1) * policy.prefix_to_share(part, [[] for _ in part])
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="webshop_paper")
    ap.add_argument("--tasks", type=int, default=None, help="goals per iteration (default: the experiment's)")
    ap.add_argument("--actors", nargs="+", default=["random", "noisy", "expert"],
                    choices=["random", "noisy", "expert"])
    ap.add_argument("--epsilon", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    import src  # noqa: F401 - config resolvers
    from src.data.rollout_config import RolloutConfig
    from src.models.policy import MIN_SHARED_PREFIX, build_policy
    from src.models.prompt_cache import PromptKV, SharedPrefixes

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train.yaml", overrides=[f"experiment={args.experiment}", "model=smollm2"],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    data, env_cfg = cfg.data, cfg.env
    n_tasks = args.tasks or int(data.tasks_per_iteration)
    group, micro = int(data.group_size), int(data.micro_batch_size)
    max_prompt_tokens = 4096  # the experiment's (model.policy.max_prompt_tokens); model=smollm2 would say 2048
    policy = build_policy(cfg.model.policy.name_or_path, cfg.model.policy.cache_dir, trainable=False,
                          max_prompt_tokens=max_prompt_tokens)
    env = instantiate(env_cfg)
    rollout_cfg = RolloutConfig(history_length=int(data.history_length), history_action=str(data.history_action),
                                max_response_tokens=int(data.max_response_tokens))
    tasks = random.Random(args.seed).sample(env.tasks("train"), n_tasks)
    print(f"{args.experiment}: {n_tasks} goals x {group} episodes, history {data.history_length} steps "
          f"({data.history_action} actions), prompt budget {max_prompt_tokens} tokens, micro-batch {micro}; "
          f"tokenizer {cfg.model.policy.name_or_path}")
    print("| actor | steps | mean prompt tokens | generation: saved | scoring and update: saved |")
    print("|---|---|---|---|---|")
    for actor in args.actors:
        episodes = [episode_prompts(env, policy, rollout_cfg, task, actor, args.seed * 1000 + 10 * t + e,
                                    args.epsilon, int(env_cfg.max_steps))
                    for t, task in enumerate(tasks) for e in range(group)]
        # the rollout: one generation call per step over the episodes still running
        shared = SharedPrefixes(MIN_SHARED_PREFIX)
        for step in range(max(map(len, episodes))):
            batch = [ep[step].rollout_ids for ep in episodes if step < len(ep)]
            shared.for_batch(lambda ids, past: PromptKV([], len(ids)), batch)
        generation = 1 - shared.computed_tokens / shared.prompt_tokens
        rows = [p.update_ids for ep in episodes for p in ep]
        total = sum(map(len, rows))
        update = chunked_saving(rows, policy, micro) / total
        print(f"| {actor} | {len(rows)} | {total / len(rows):.0f} | {generation:.1%} | {update:.1%} |", flush=True)
    env.close()


if __name__ == "__main__":
    main()
