"""Where the time of a training iteration goes, read from an MLflow run (default: the newest in logs/mlflow.db).

    python src/train.py experiment=scienceworld            # any run
    python scripts/bench_iteration.py [--run-id ID] [--tracking-uri sqlite:///logs/mlflow.db]

Prints per iteration: mode, rollout time and its parts (generation, environment steps, memory = embedding +
retrieval + novelty), tip writing, old log-probs, the update, rollout tokens/s and the memory's share of the
rollout phase ((memory + tip writing) / (rollout + tip writing)).
"""
from __future__ import annotations

import argparse

import mlflow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default="sqlite:///logs/mlflow.db")
    parser.add_argument("--experiment", default="empo2")
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args()
    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    if args.run_id is None:
        exp = client.get_experiment_by_name(args.experiment)
        if exp is None:
            raise SystemExit(f"no MLflow experiment {args.experiment!r} in {args.tracking_uri}")
        runs = client.search_runs([exp.experiment_id], order_by=["start_time DESC"], max_results=1)
        if not runs:
            raise SystemExit(f"experiment {args.experiment!r} has no runs")
        args.run_id = runs[0].info.run_id
    run = client.get_run(args.run_id)

    def series(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(args.run_id, key), key=lambda m: m.step)]

    keys = ["rollout/rollout_s", "rollout/generate_s", "rollout/env_s", "rollout/memory_s", "rollout/tip_generate_s",
            "rollout/tip_write_s",
            "rollout/old_log_prob_s", "rollout/rollout_tokens_per_s", "rollout/generated_tokens", "rollout/adv/samples"]
    data = {k: series(k) for k in keys}
    modes = {m: series(f"rollout/mode_{m}") for m in ("on_policy", "on_policy_with_tips", "off_policy")}
    update = series("train/update_s")
    per_iter = max(1, len(update) // max(1, len(data["rollout/rollout_s"])))
    duration = ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000
    print(f"run {run.info.run_name} ({args.run_id}), wall clock {duration:.0f} s")
    header = ("iter", "mode", "rollout_s", "generate_s", "env_s", "memory_s", "tips_s", "old_lp_s", "update_s",
              "samples", "tok/s", "mem share")
    print(("{:>5} {:>20} " + "{:>10} " * 10).format(*header))
    for i, rollout in enumerate(data["rollout/rollout_s"]):
        mode = next((m for m, v in modes.items() if i < len(v) and v[i] == 1.0), "?")
        get = lambda k: data[k][i] if i < len(data[k]) else float("nan")  # noqa: E731
        # the whole tip writing (prompts, generation, storage); runs before it was logged: the generation only
        tips = get("rollout/tip_write_s") if data["rollout/tip_write_s"] else get("rollout/tip_generate_s")
        upd = sum(update[i * per_iter:(i + 1) * per_iter])
        share = (get("rollout/memory_s") + tips) / (rollout + tips)
        print(("{:>5} {:>20} " + "{:>10.1f} " * 7 + "{:>10.0f} {:>10.1f} {:>9.0%}").format(
            i, mode, rollout, get("rollout/generate_s"), get("rollout/env_s"), get("rollout/memory_s"), tips,
            get("rollout/old_log_prob_s"), upd, get("rollout/adv/samples"), get("rollout/rollout_tokens_per_s"), share))


if __name__ == "__main__":
    main()
