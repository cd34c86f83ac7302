"""Rebuild the run records (runs/*.json) of GRPO and GRPO + novelty seed 1, whose MLflow store was lost.

The two runs ran on 2026-12-04, before `scripts/compare_runs.py` wrote run records; the next session's checkout
had no `logs/`. Their numbers survive in this directory's files as committed at commit e72688b (read from git,
whatever the files hold now): `curves.json`
(rollout and validation curves at full precision, with minutes since the run's start), `iterations.md` (the
per-iteration columns as printed) and `results.md` (seconds per iteration). This script turns them back into
records, so that `compare_runs.py` compares them beside the runs of later sessions; the records carry the tag
`empo2.record_reconstructed` saying so. What the files did not keep (other metrics, exact start times,
parameters beyond the four below) is not in the records: the start time is set to 00:00 UTC of the runs' day.

    python docs/results/webshop-seeds/rebuild_seed1_records.py   # runs/grpo-seed1.json, runs/grpo_novelty-seed1.json
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = "e72688b"  # the commit whose files hold the two runs (later comparisons rewrite them with more runs)
DAY_START_MS = 1_796_342_400_000  # 2026-12-04 00:00 UTC
COMMIT = "a9cdc4722897bd2c81d661c9845f8c711a523658"  # the frozen checkout the two runs ran from
TIMING_S = {"grpo": (86, 101), "grpo_novelty": (95, 116)}  # results.md: rollout / update s per iteration
WARM_START = (0.041, 0.22)  # results.md: the warm start's held-out s.e. and success (its score is in curves.json)
# iterations.md columns -> metric, and how the printed summary is logged back ("first/max": two points)
TAGS = {"mlflow.source.git.commit": COMMIT, "precision_used": "bf16-mixed",
        "machine": "Intel Xeon with AMX, 2 cores",
        "empo2.record_reconstructed": "rebuilt by docs/results/webshop-seeds/rebuild_seed1_records.py from "
        "curves.json, iterations.md and results.md of commit e72688b (the run's store was lost)"}
COLUMNS = {"zero-variance groups": ("rollout/adv/zero_var_group_frac", "last"),
           "approx_kl first / max": ("train/approx_kl", "first/max"),
           "clip frac": ("train/clip_frac", "mean"), "masked frac": ("train/masked_frac", "mean")}


def committed(name: str) -> str:
    """This directory's file ``name`` as of commit SOURCE."""
    return subprocess.run(["git", "show", f"{SOURCE}:docs/results/webshop-seeds/{name}"], cwd=HERE, check=True,
                          capture_output=True, text=True).stdout


def iteration_rows(run_name: str) -> dict[int, dict[str, str]]:
    lines = committed("iterations.md").splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        if cells["run"] == run_name:
            rows[int(cells["iteration"])] = cells
    return rows


def record(info: dict, curves: dict) -> dict:
    algo, start = info["algorithm"], DAY_START_MS
    ts = lambda minutes: start + round(minutes * 60_000)  # noqa: E731
    metrics: dict[str, list] = {}
    add = lambda key, step, t, value: metrics.setdefault(key, []).append([step, t, float(value)])  # noqa: E731
    score = curves["rollout/score"]
    rows = iteration_rows(info["name"])
    for k, (it, minutes) in enumerate(zip(score["iteration"], score["minutes"])):
        t, it = ts(minutes), int(it)
        add("iteration", it, t, it)
        for key in ("rollout/return", "rollout/score", "rollout/success_rate"):
            add(key, it, t, curves[key]["mean"][k])
        add(f"rollout/mode_{rows[it]['mode']}", it, t, 1.0)
        add("rollout/rollout_s", it, t, TIMING_S[algo][0])
        add("train/update_s", it, t + 1, TIMING_S[algo][1])
        for column, (key, how) in COLUMNS.items():
            cell = rows[it][column]
            if cell == "–":
                continue
            values = [float(v) for v in cell.split(" / ")] if how == "first/max" else [float(cell)]
            for j, value in enumerate(values):
                add(key, it, t + 1 + j, value)
    val = curves["val/score"]
    for k, (it, minutes) in enumerate(zip(val["iteration"], val["minutes"])):
        if it == 0:  # the warm start's held-out result, logged at the run's start
            add("warm_start/score", 0, start, val["mean"][k])
            add("warm_start/score_stderr", 0, start, WARM_START[0])
            add("warm_start/success_rate", 0, start, WARM_START[1])
            continue
        add("val/score", 1000 + int(it), ts(minutes), val["mean"][k])
        add("val/success_rate", 1000 + int(it), ts(minutes), curves["val/success_rate"]["mean"][k])
    return {"record_version": 1, "run_id": info["run_id"], "run_name": info["name"], "status": info["status"],
            "start_time": start, "end_time": ts(info["minutes"]),
            "params": {"algorithm/name": algo, "env/_target_": "src.envs.webshop.WebShopEnv", "seed": info["seed"],
                       "tags": "['webshop', 'cpu', 'study-webshop3']"},
            "tags": dict(sorted((TAGS | {"mlflow.runName": info["name"]}).items())),
            "metrics": {key: sorted(rows) for key, rows in sorted(metrics.items())}}


def main() -> None:
    curves = json.loads(committed("curves.json"))
    for info in curves["run_info"]:
        assert info["seed"] == "1" and curves["curves"][info["algorithm"]]["rollout/score"]["n"][0] == 1  # one run
        path = HERE / "runs" / f"{info['algorithm']}-seed{info['seed']}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(record(info, curves["curves"][info["algorithm"]]), separators=(",", ":")) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
