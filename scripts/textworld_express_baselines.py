"""Reference scores of TextWorldExpress on held-out seeds: a uniform random agent over the valid actions and the
gold path (`gold_actions`; its loops that show nothing new cut, as the demonstrations are), under the experiment's step
cap (docs/environments.md#textworldexpress).

    python scripts/textworld_express_baselines.py                       # experiment=coin's game, 50 test seeds
    python scripts/textworld_express_baselines.py --max-steps 20 --out docs/results/coin/baselines.json

The random agent draws each action from the listed valid actions (seeded per episode); the gold path explores
(it is no shortest path: the agent cannot see where the coin is), cut at the step cap.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.evaluation.stats import mean_stderr  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--game", default="coin")
    ap.add_argument("--game-params", default='{"numLocations": 4, "includeDoors": 1, "numDistractorItems": 0}',
                    help="JSON of the simulator's generation parameters (default: experiment=coin's)")
    ap.add_argument("--max-steps", type=int, default=12, help="step cap (default: experiment=coin's %(default)s)")
    ap.add_argument("--num-seeds", type=int, default=50, help="first N seeds of the test fold")
    ap.add_argument("--random-episodes", type=int, default=4, help="random-agent episodes per seed")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    from src.envs.textworld_express import TextWorldExpressEnv

    env = TextWorldExpressEnv(game=args.game, game_params=json.loads(args.game_params), max_steps=args.max_steps,
                              num_test_seeds=args.num_seeds)
    try:
        tasks = env.tasks("test")
        gold = [env.without_loops(t, env.gold_actions(t)) for t in tasks]
        gold_runs = [_play(env, t, iter(g).__next__) for t, g in zip(tasks, gold)]
        random_runs = []
        for t in tasks:
            for k in range(args.random_episodes):
                rng = random.Random(f"{t['variation']}/{k}")
                random_runs.append(_play(env, t, None, rng))
    finally:
        env.close()
    summary = {"game": args.game, "game_params": json.loads(args.game_params), "max_steps": args.max_steps,
               "split": "test", "seeds": [t["variation"] for t in tasks],
               "random": _summary(random_runs), "gold": _summary(gold_runs),
               "gold_path_length": mean_stderr([float(len(g)) for g in gold])}
    print(json.dumps({k: summary[k] for k in ("random", "gold", "gold_path_length")}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _play(env, task, next_action=None, rng=None) -> dict:
    observation, info = env.reset(task)
    done, steps = False, 0
    while not done:
        try:
            action = next_action() if next_action else rng.choice(info["admissible_actions"])
        except StopIteration:  # the gold path ended without success (it never does within the cap it was made for)
            break
        observation, _, terminated, truncated, info = env.step(action)
        steps += 1
        done = terminated or truncated
    return {"score": float(info["score"]), "success": bool(info["success"]), "steps": steps}


def _summary(runs: list[dict]) -> dict:
    return {"episodes": len(runs), "score": mean_stderr([r["score"] for r in runs]),
            "success_rate": mean_stderr([float(r["success"]) for r in runs]),
            "episode_length": mean_stderr([float(r["steps"]) for r in runs])}


if __name__ == "__main__":
    main()
