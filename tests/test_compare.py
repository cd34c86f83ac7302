"""The GRPO-vs-EMPO² comparison (scripts/compare_runs.py) and the study launcher (scripts/run_study.py).

Known-answer tests use a real MLflow sqlite store with runs logged through the MLflow client in the layout of
src/train.py (values and timestamps chosen by hand); the end-to-end test reads two real short training runs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib.image
import mlflow
import numpy as np
import pytest
from mlflow.entities import Metric, Param

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import compare_runs, run_study  # noqa: E402
from studies.comparison import adaptation, curves, table  # noqa: E402
from src.envs.scienceworld import ScienceWorldEnv  # noqa: E402
from studies.comparison import records as run_records  # noqa: E402
from studies.comparison import runs as comparison_runs  # noqa: E402

T0 = 1_700_000_000_000  # run start (ms since epoch)
MIN = 60_000           # one minute in ms
SW = "src.envs.scienceworld.ScienceWorldEnv"
CURVE_PX = (550, 1760)  # learning-curve PNG (height, width) = FIGSIZE (16 x 5 in) x 110 dpi
ADAPT_PX = (550, 880)   # adaptation PNG: 8 x 5 in x 110 dpi


def _log_run(client, exp_id: str, algo: str, seed: int, rollouts, vals=(), tags=("scienceworld", "cpu"),
             env: str = SW, status: str = "FINISHED") -> str:
    """A run as src/train.py logs it. ``rollouts``: (step, minutes, iteration, score); return = score + 1,
    success = score >= 50. ``vals``: (step, minutes, val score)."""
    run = client.create_run(exp_id, start_time=T0, run_name=f"{algo}-{tags[0]}-seed{seed}")
    rid = run.info.run_id
    params = {"algorithm/name": algo, "seed": str(seed), "env/_target_": env, "tags": str(list(tags)),
              "env/task": "find-non-living-thing"}
    metrics = []
    for step, minutes, it, score in rollouts:
        ts = T0 + int(minutes * MIN)
        metrics += [Metric("iteration", it, ts, step), Metric("rollout/score", score, ts, step),
                    Metric("rollout/return", score + 1, ts, step),
                    Metric("rollout/success_rate", float(score >= 50), ts, step)]
    for step, minutes, score in vals:
        ts = T0 + int(minutes * MIN)
        metrics += [Metric("val/score", score, ts, step), Metric("val/success_rate", 0.5, ts, step)]
    client.log_batch(rid, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
    if status != "RUNNING":
        client.set_terminated(rid, status=status, end_time=T0 + 10 * MIN)
    return rid


@pytest.fixture()
def store(tmp_path):
    """GRPO seeds 1, 2 and EMPO² seed 1 (finished), plus runs that must not be selected."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("empo2", artifact_location=str(tmp_path / "mlartifacts"))
    ids = {
        "grpo1": _log_run(client, exp_id, "grpo", 1, [(0, 1, 0, 10.0), (2, 3, 1, 20.0)], [(4, 4, 25.0)]),
        "grpo2": _log_run(client, exp_id, "grpo", 2, [(0, 2, 0, 30.0), (2, 4, 1, 60.0)], [(4, 5, 35.0)]),
        "empo1": _log_run(client, exp_id, "empo2", 1, [(0, 2, 0, 0.0), (2, 6, 1, 50.0)], [(4, 7, 40.0)]),
        # excluded: still running; an SFT run (other tag); a WebShop run
        "running": _log_run(client, exp_id, "empo2", 3, [(0, 1, 0, 99.0)], status="RUNNING"),
        "sft": _log_run(client, exp_id, "empo2", 4, [(0, 1, 0, 99.0)], tags=("sft",)),
        "webshop": _log_run(client, exp_id, "grpo", 5, [(0, 1, 0, 0.5)], tags=("webshop", "cpu"),
                            env="src.envs.webshop.WebShopEnv"),
    }
    return {"uri": uri, "client": client, "exp_id": exp_id, "ids": ids, "tmp": tmp_path}


def test_select_runs_by_tag_status_and_algorithm(store):
    client, ids = store["client"], store["ids"]
    runs = comparison_runs.select_runs(client, "empo2", tags=["scienceworld"])
    assert {r.info.run_id for r in runs} == {ids["grpo1"], ids["grpo2"], ids["empo1"]}
    runs = comparison_runs.select_runs(client, "empo2", tags=["scienceworld"], include_unfinished=True)
    assert ids["running"] in {r.info.run_id for r in runs}
    assert [r.info.run_id for r in comparison_runs.select_runs(client, "empo2", run_ids=[ids["sft"]])] == [ids["sft"]]
    with pytest.raises(ValueError, match="no MLflow experiment named 'nope'"):
        comparison_runs.select_runs(client, "nope")
    with pytest.raises(ValueError, match=r"tags \['absent'\]"):
        comparison_runs.select_runs(client, "empo2", tags=["absent"])
    with pytest.raises(ValueError, match="mix environments"):
        comparison_runs.run_environment(comparison_runs.select_runs(client, "empo2", tags=["cpu"]))
    webshop = comparison_runs.run_environment(comparison_runs.select_runs(client, "empo2", tags=["webshop"]))
    assert webshop.display_name == "WebShop" and webshop.score_unit == "score in [0, 1]"


def test_curves_carry_iterations_minutes_and_values(store):
    client = store["client"]
    run = client.get_run(store["ids"]["grpo2"])
    c = comparison_runs.rollout_curve(client, run, "rollout/score")
    np.testing.assert_array_equal(c.iteration, [0, 1])
    np.testing.assert_allclose(c.minutes, [2, 4])
    np.testing.assert_array_equal(c.value, [30, 60])
    v = comparison_runs.val_curve(client, run, "val/score")
    # validation after iteration 1 played the policy after 2 iterations of updates
    np.testing.assert_array_equal(v.iteration, [2])
    np.testing.assert_allclose(v.minutes, [5])
    np.testing.assert_array_equal(v.value, [35])


def test_iterations_sharing_a_step_are_told_apart_by_timestamp(tmp_path):
    # an iteration without an optimizer step leaves the next rollout at the same MLflow step
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    exp_id = client.create_experiment("empo2", artifact_location=str(tmp_path / "a"))
    rid = _log_run(client, exp_id, "grpo", 1, [(0, 1, 0, 5.0), (0, 2, 1, 7.0), (1, 3, 2, 9.0)])
    c = comparison_runs.rollout_curve(client, client.get_run(rid), "rollout/score")
    np.testing.assert_array_equal(c.iteration, [0, 1, 2])
    np.testing.assert_array_equal(c.value, [5, 7, 9])


def test_aggregate_mean_and_standard_error_by_hand():
    a = curves.Curve(np.array([0.0, 1.0]), np.array([1.0, 3.0]), np.array([10.0, 20.0]))
    b = curves.Curve(np.array([0.0, 1.0, 2.0]), np.array([2.0, 4.0, 6.0]), np.array([30.0, 60.0, 7.0]))
    agg = curves.aggregate([a, b])
    np.testing.assert_array_equal(agg.iteration, [0, 1, 2])
    np.testing.assert_allclose(agg.mean, [20, 40, 7])
    # s.e. = sample std / sqrt(2): |30 - 10| / 2 = 10 and |60 - 20| / 2 = 20; one seed: undefined
    np.testing.assert_allclose(agg.sem[:2], [10, 20])
    assert np.isnan(agg.sem[2])
    np.testing.assert_allclose(agg.minutes, [1.5, 3.5, 6])
    np.testing.assert_array_equal(agg.n, [2, 2, 1])


def _eval_summary(scores, stderr, ckpt_path) -> dict:
    """The adaptation summary layout of src/eval.py (eval.protocol=adaptation)."""
    return {"protocol": "adaptation", "ckpt_path": ckpt_path, "env": SW, "task": "chemistry-mix-paint-secondary-color",
            "trials": [{"trial": i, "memory": i > 0, "score": s, "score_stderr": e}
                       for i, (s, e) in enumerate(zip(scores, stderr))]}


def _adaptation_files(tmp: Path) -> list[str]:
    """Two EMPO² evaluations (algorithm found through the checkpoint's Hydra config), a labelled GRPO file in the
    ``trial_scores`` layout, and a base-model evaluation."""
    specs = []
    for name, scores in (("runA", [10, 20, 30]), ("runB", [20, 40, 30])):
        (tmp / name / ".hydra").mkdir(parents=True, exist_ok=True)
        (tmp / name / ".hydra" / "config.yaml").write_text("algorithm:\n  name: empo2\nseed: 1\n")
        path = tmp / name / "eval_summary.json"
        path.write_text(json.dumps(_eval_summary(scores, [1, 2, 3], str(tmp / name / "checkpoints" / "last.ckpt"))))
        specs.append(str(path))
    (tmp / "grpo.json").write_text(json.dumps({"trial_scores": [[10, 30], [40, 40], [15, 25]]}))
    specs.append(f"GRPO policy={tmp / 'grpo.json'}")
    base = tmp / "multirun" / "eval.trials=2"  # a Hydra multirun directory: '=' in an existing path
    base.mkdir(parents=True, exist_ok=True)
    (base / "eval_summary.json").write_text(json.dumps(_eval_summary([0, 5, 4], [1, 1, 2], None)))
    specs.append(str(base / "eval_summary.json"))
    return specs


def test_load_adaptation_formats_and_errors(tmp_path):
    adapt = adaptation.load_adaptation(_adaptation_files(tmp_path))
    assert list(adapt) == ["EMPO²", "GRPO policy", "base model (untrained)"]
    np.testing.assert_array_equal(adapt["EMPO²"]["scores"], [[10, 20, 30], [20, 40, 30]])
    assert adapt["EMPO²"]["stderr"] is None  # two evaluations: the band is their standard error
    np.testing.assert_array_equal(adapt["GRPO policy"]["scores"], [[20, 40, 20]])  # per-episode lists averaged
    np.testing.assert_array_equal(adapt["base model (untrained)"]["stderr"], [1, 1, 2])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mean_score": 3.0}))
    with pytest.raises(ValueError, match="bad.json: no per-trial scores"):
        adaptation.load_adaptation([bad])
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"algorithm": "empo2", "trial_scores": [1, 2]}))
    with pytest.raises(ValueError, match="short.json: 2 trials"):
        adaptation.load_adaptation([*_adaptation_files(tmp_path)[:1], short])


def _read_png(path: Path) -> np.ndarray:
    assert path.stat().st_size > 10_000, path
    return matplotlib.image.imread(path)


def test_main_writes_pngs_json_and_logs_artifacts(store):
    out = store["tmp"] / "cmp"
    result = compare_runs.main(["--tracking-uri", store["uri"], "--tag", "scienceworld", "--out-dir", str(out),
                                "--adaptation", *_adaptation_files(store["tmp"])])
    names = {"learning_curves_iteration.png", "learning_curves_wallclock.png", "adaptation.png", "curves.json",
             "results.md", "iterations.md"}
    records = {"runs/grpo-seed1.json", "runs/grpo-seed2.json", "runs/empo2-seed1.json"}
    assert {f.relative_to(out).as_posix() for f in result["files"]} == names | records
    for name in ("learning_curves_iteration.png", "learning_curves_wallclock.png"):
        img = _read_png(out / name)
        assert img.shape[:2] == CURVE_PX and img[..., :3].std() > 0.05  # not blank
    assert _read_png(out / "adaptation.png").shape[:2] == ADAPT_PX
    report = json.loads((out / "curves.json").read_text())
    assert report["env"] == "ScienceWorld" and "find-non-living-thing" in report["title"]
    score = report["curves"]["grpo"]["rollout/score"]
    assert score["iteration"] == [0, 1] and score["mean"] == [20, 40] and score["minutes"] == [1.5, 3.5]
    np.testing.assert_allclose(score["sem"], [10, 20])
    assert report["curves"]["grpo"]["val/score"]["mean"] == [30] and report["curves"]["empo2"]["val/score"][
        "sem"] == [None]
    assert report["curves"]["empo2"]["rollout/return"]["mean"] == [1, 51]
    # EMPO² trial means 15, 30, 30 with s.e. |20 - 10| / 2 = 5, 10, 0: best gain (30 - 15) / 15 = 1
    adapt = report["adaptation"]
    assert adapt["EMPO²"]["mean"] == [15, 30, 30] and adapt["EMPO²"]["sem"] == pytest.approx([5, 10, 0])
    assert adapt["EMPO²"]["best_relative_gain"] == pytest.approx(1.0)
    assert adapt["GRPO policy"]["sem"] == [None, None, None] and adapt["GRPO policy"]["best_relative_gain"] == 1.0
    # one evaluation: its own per-trial s.e.; a zero trial-0 score leaves the relative gain undefined
    assert adapt["base model (untrained)"]["sem"] == [1, 1, 2]
    assert adapt["base model (untrained)"]["best_relative_gain"] is None
    client = store["client"]
    comp = client.get_run(result["comparison_run_id"])
    assert comp.info.run_name == "comparison-scienceworld" and comp.info.status == "FINISHED"
    assert set(comp.data.params["runs/grpo"].split(",")) == {store["ids"]["grpo1"], store["ids"]["grpo2"]}
    assert {a.path for a in client.list_artifacts(comp.info.run_id)} == names | {"runs"}
    assert {a.path for a in client.list_artifacts(comp.info.run_id, "runs")} == records
    # the comparison run is not itself picked up as a training run
    assert len(comparison_runs.select_runs(client, "empo2", tags=["scienceworld"])) == 3


def test_results_table_known_answers(store):
    """Final validation per run (GRPO 25 and 35: mean 30, s.e. 10 / 2 = 5; EMPO² one run: no s.e.), iterations,
    minutes, no timings and no warm start logged."""
    client = store["client"]
    runs = comparison_runs.select_runs(client, "empo2", tags=["scienceworld"])
    lines = table.results_table(client, runs, ScienceWorldEnv).splitlines()
    assert lines[2] == "| GRPO | 1, 2 | 2 | 10 | – / – / – | none | 30.0 ± 5.0 | 0.50 ± 0.00 |"
    assert lines[3] == "| EMPO² | 1 | 2 | 10 | – / – / – | none | 40.0 | 0.50 |"


def test_warm_start_is_the_validation_point_at_iteration_0(store):
    client = store["client"]
    rid = store["ids"]["grpo1"]
    client.log_batch(rid, metrics=[Metric("warm_start/score", 12.0, T0, 0), Metric("warm_start/score_stderr", 2.0, T0, 0),
                                   Metric("warm_start/success_rate", 0.25, T0, 0),
                                   Metric("train/update_s", 30.0, T0 + 1 * MIN, 1),
                                   Metric("train/update_s", 20.0, T0 + 1 * MIN + 500, 2)])
    curve = comparison_runs.val_curve(client, client.get_run(rid), "val/score")
    assert curve.iteration.tolist() == [0, 2] and curve.value.tolist() == [12.0, 25.0]
    assert curve.minutes.tolist() == [0.0, 4.0]
    row = table.results_table(client, [client.get_run(rid)], ScienceWorldEnv).splitlines()[2]
    # update time summed within iteration 0 (two optimizer steps), averaged over the run's 2 iterations
    assert row == "| GRPO | 1 | 2 | 10 | – / – / 25 | 12.0 ± 2.0 / 0.25 | 25.0 | 0.50 |"


def test_warm_starts_that_differ_between_runs_are_each_shown_with_their_seeds(store):
    """The same warm-start config built on two machines rounds to other weights and scores differently: the row
    names each result and the seeds that started from it, rather than the first run's for all."""
    client = store["client"]
    for key, seed, (score, se, succ) in (("grpo1", 1, (0.675, 0.041, 0.22)), ("grpo2", 2, (0.659, 0.038, 0.20))):
        client.log_batch(store["ids"][key], metrics=[
            Metric("warm_start/score", score, T0, 0), Metric("warm_start/score_stderr", se, T0, 0),
            Metric("warm_start/success_rate", succ, T0, 0)])
    from src.envs.webshop import WebShopEnv  # scores in [0, 1]: three digits

    runs = [client.get_run(store["ids"][k]) for k in ("grpo1", "grpo2")]
    row = table.results_table(client, runs, WebShopEnv).splitlines()[2]
    assert "| 0.675 ± 0.041 / 0.22 (seed 1); 0.659 ± 0.038 / 0.20 (seed 2) |" in row
    client.log_batch(store["ids"]["grpo2"], metrics=[  # now the same warm start as seed 1
        Metric("warm_start/score", 0.675, T0 + 1, 0), Metric("warm_start/score_stderr", 0.041, T0 + 1, 0),
        Metric("warm_start/success_rate", 0.22, T0 + 1, 0)])
    runs = [client.get_run(store["ids"][k]) for k in ("grpo1", "grpo2")]
    assert "| 0.675 ± 0.041 / 0.22 | 30.000 ± 5.000 |" in table.results_table(client, runs, WebShopEnv).splitlines()[2]


def test_iterations_table_known_answers(store):
    """EMPO² seed 1: iteration 0 on policy (two optimizer steps, approx_kl 0 then 0.02), iteration 1 off policy
    (approx_kl 0.5 then 0.1, clip 0.1 and 0.3: mean 0.2; 8 tips, a quarter of them actions, half the queries hit;
    a quarter of the groups ranked by the novelty bonus alone in iteration 1). GRPO logs no memory metrics: dashes."""
    client, rid = store["client"], store["ids"]["empo1"]

    def at(minutes, ms=0):  # the run's rollouts are at minutes 2 and 6
        return T0 + int(minutes * MIN) + ms

    metrics = [Metric("rollout/mode_on_policy", 1.0, at(2), 0), Metric("rollout/mode_off_policy", 0.0, at(2), 0),
               Metric("rollout/mode_on_policy", 0.0, at(6), 2), Metric("rollout/mode_off_policy", 1.0, at(6), 2),
               Metric("rollout/adv/zero_var_group_frac", 0.5, at(2), 0),
               Metric("rollout/adv/zero_var_group_frac", 0.0, at(6), 2),
               Metric("rollout/adv/bonus_only_group_frac", 0.0, at(2), 0),
               Metric("rollout/adv/bonus_only_group_frac", 0.25, at(6), 2),
               Metric("rollout/tips_written", 8.0, at(6), 2), Metric("rollout/tip_action_frac", 0.25, at(6), 2),
               Metric("rollout/memory/hit_rate", 0.5, at(6), 2)]
    for minutes, kls, clips in ((3, (0.0, 0.02), (0.0, 0.0)), (7, (0.5, 0.1), (0.1, 0.3))):
        for k, (kl, clip) in enumerate(zip(kls, clips)):
            metrics += [Metric("train/approx_kl", kl, at(minutes, k), 10 + k),
                        Metric("train/clip_frac", clip, at(minutes, k), 10 + k)]
    client.log_batch(rid, metrics=metrics)
    runs = [client.get_run(rid), client.get_run(store["ids"]["grpo1"])]
    lines = table.iterations_table(client, runs, ScienceWorldEnv).splitlines()
    assert lines[0].startswith("| run | iteration | mode | rollout score | zero-variance groups | bonus-only groups "
                               "| approx_kl first")
    assert lines[2] == "| grpo-scienceworld-seed1 | 0 | – | 10.0 | – | – | – | – | – | – | – | – |"
    assert lines[4] == ("| empo2-scienceworld-seed1 | 0 | on_policy | 0.0 | 0.50 | 0.00 | 0.000 / 0.020 | 0.000 | – "
                        "| – | – | – |")
    assert lines[5] == ("| empo2-scienceworld-seed1 | 1 | off_policy | 50.0 | 0.00 | 0.25 | 0.500 / 0.500 | 0.200 "
                        "| – | 8 | 0.25 | 0.50 |")


def _log_episodes(client, rid: str, scores, tmp: Path) -> None:
    """A ``validation_episodes.csv`` artifact: one episode per task at iteration 2."""
    path = tmp / rid / "validation_episodes.csv"
    path.parent.mkdir(parents=True)
    rows = [f"2,task{i},{i},{s},{int(s >= 50)},3,0" for i, s in enumerate(scores)]
    path.write_text("iteration,task,episode,score,success,steps,failed\n" + "\n".join(rows) + "\n")
    client.log_artifact(rid, str(path))


def test_run_records_carry_a_study_to_a_new_store(store):
    """A study compared in one store, continued in a fresh one (a new session's checkout has no logs/): the records
    in <out>/runs bring the earlier runs back, so the comparison holds old and new runs, and the tables of the old
    runs read the same as in their own store."""
    client, tmp = store["client"], store["tmp"]
    _log_episodes(client, store["ids"]["grpo1"], [10.0, 30.0], tmp)
    _log_episodes(client, store["ids"]["empo1"], [40.0, 60.0], tmp)
    out = tmp / "study"
    first = compare_runs.main(["--tracking-uri", store["uri"], "--tag", "scienceworld", "--out-dir", str(out),
                               "--no-log"])
    before = {name: (out / name).read_text() for name in ("results.md", "iterations.md", "paired.md")}
    curves_before = json.loads((out / "curves.json").read_text())
    recorded = {p.name: p.read_bytes() for p in (out / "runs").glob("*.json")}
    assert sorted(recorded) == ["empo2-seed1.json", "grpo-seed1.json", "grpo-seed2.json"]
    rec = json.loads(recorded["grpo-seed1.json"])
    assert rec["run_id"] == store["ids"]["grpo1"] and rec["params"]["seed"] == "1"
    assert rec["metrics"]["rollout/score"] == [[0, T0 + 1 * MIN, 10.0], [2, T0 + 3 * MIN, 20.0]]

    # the next session: an empty store with one new run (EMPO² seed 2)
    uri2 = f"sqlite:///{tmp}/second.db"
    client2 = mlflow.MlflowClient(tracking_uri=uri2)
    exp2 = client2.create_experiment("empo2", artifact_location=str(tmp / "mlartifacts2"))
    new = _log_run(client2, exp2, "empo2", 2, [(0, 1, 0, 20.0), (2, 2, 1, 30.0)], [(4, 3, 50.0)])
    _log_episodes(client2, new, [50.0, 70.0], tmp)
    second = compare_runs.main(["--tracking-uri", uri2, "--tag", "scienceworld", "--out-dir", str(out), "--no-log"])
    assert sorted(second["runs"])[0] != sorted(first["runs"])[0]  # the imported runs got ids of the new store
    curves_after = json.loads((out / "curves.json").read_text())
    assert {i["run_id"] for i in curves_after["run_info"]} == set(first["runs"]) | {new}  # original ids reported
    assert curves_after["curves"]["grpo"] == curves_before["curves"]["grpo"]
    assert curves_after["curves"]["empo2"]["val/score"]["mean"] == [45.0]  # EMPO² seeds 1 (40) and 2 (50)
    results = (out / "results.md").read_text().splitlines()
    assert results[2] == before["results.md"].splitlines()[2]  # GRPO, from records only: unchanged
    assert results[3] == "| EMPO² | 1, 2 | 2 | 10 | – / – / – | none | 45.0 ± 5.0 | 0.50 ± 0.00 |"
    assert before["iterations.md"].splitlines()[2] in (out / "iterations.md").read_text().splitlines()
    paired = json.loads((out / "paired.json").read_text())
    assert paired["empo2-grpo"]["seed_level"]["n_seeds"] == [2, 1]  # seed 1's CSV came back from the record
    for name, data in recorded.items():  # records are written back with their original ids: unchanged
        assert (out / "runs" / name).read_bytes() == data
    assert (out / "runs" / "empo2-seed2.json").exists()

    # a third pass imports nothing again
    compare_runs.main(["--tracking-uri", uri2, "--tag", "scienceworld", "--out-dir", str(out), "--no-log"])
    assert len(client2.search_runs([exp2])) == 4


def test_a_file_that_is_not_a_run_record_is_refused(tmp_path):
    (tmp_path / "grpo-seed1.json").write_text('{"record_version": 7}')
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    with pytest.raises(ValueError, match=r"grpo-seed1.json: expected a run record with record_version 1, found 7"):
        run_records.import_records(client, "empo2", tmp_path)
    assert client.search_runs([client.get_experiment_by_name("empo2").experiment_id]) == []


def _records_of(store, out: Path, *keys: str) -> Path:
    """Records of the fixture's runs ``keys`` written to ``out`` (a study directory's runs/)."""
    client = store["client"]
    run_records.write_records(client, [client.get_run(store["ids"][k]) for k in keys], out)
    return out


def _fresh_store(tmp: Path, name: str):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}/{name}.db")
    return client, client.create_experiment("empo2", artifact_location=str(tmp / f"{name}-artifacts"))


def test_a_record_taken_while_its_run_was_running_is_replaced_when_the_run_goes_on(store):
    """Recorded while RUNNING (no end time: the copy keeps none, rather than the import's time), imported elsewhere,
    then the run finished and its record was rewritten: the next import replaces the stale copy, which a
    comparison would otherwise write back over the newer file."""
    client, tmp = store["client"], store["tmp"]
    rid = store["ids"]["running"]
    records = _records_of(store, tmp / "runs", "running")
    client2, exp2 = _fresh_store(tmp, "second")
    [first] = run_records.import_records(client2, "empo2", records)
    copy = client2.get_run(first)
    assert copy.info.status == "RUNNING" and copy.info.end_time is None
    assert (records / "empo2-seed3.json").read_text() == run_records._dumps(run_records.run_record(client2, copy))
    client.log_batch(rid, metrics=[Metric("rollout/score", 77.0, T0 + 5 * MIN, 2)])
    client.set_terminated(rid, status="FINISHED", end_time=T0 + 6 * MIN)
    _records_of(store, records, "running")
    [second] = run_records.import_records(client2, "empo2", records)
    assert client2.get_run(first).info.lifecycle_stage == "deleted"
    fresh = client2.get_run(second)
    assert fresh.info.status == "FINISHED" and fresh.data.metrics["rollout/score"] == 77.0
    assert run_records.import_records(client2, "empo2", records) == []  # now equal: nothing to do


def test_an_interrupted_import_leaves_no_run_that_passes_for_the_record(store, monkeypatch):
    """Ctrl-C during the artifact upload: the half-made run is deleted and the next import makes it; a run left by a
    killed import (still tagged as importing) is deleted by the next import, not taken for the record's run."""
    tmp = store["tmp"]
    _log_episodes(store["client"], store["ids"]["grpo1"], [10.0, 30.0], tmp)
    records = _records_of(store, tmp / "runs", "grpo1")
    episodes = tmp / "episodes"
    episodes.mkdir()
    (episodes / "grpo-seed1.csv").write_text("iteration,task,episode,score,success,steps,failed\n2,t,0,10,0,3,0\n")
    client2, exp2 = _fresh_store(tmp, "second")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(client2, "log_artifact", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_records.import_records(client2, "empo2", records, episodes)
    assert client2.search_runs([exp2]) == []
    monkeypatch.undo()
    ghost = client2.create_run(exp2, tags={run_records.IMPORTING_TAG: store["ids"]["grpo1"]})  # a killed import
    [rid] = run_records.import_records(client2, "empo2", records, episodes)
    assert [r.info.run_id for r in client2.search_runs([exp2])] == [rid]
    assert client2.get_run(ghost.info.run_id).info.lifecycle_stage == "deleted"
    assert run_records.IMPORTING_TAG not in client2.get_run(rid).data.tags


def test_a_run_deleted_from_the_store_stays_out_and_original_ids_find_imported_runs(store):
    """A run the user deleted is not imported again from its record; ``--run-ids`` with the ids that curves.json and
    the records report finds the imported runs; runs of one algorithm and seed are refused before any file is
    written."""
    tmp = store["tmp"]
    records = _records_of(store, tmp / "study" / "runs", "grpo1", "empo1")
    client2, exp2 = _fresh_store(tmp, "second")
    imported = run_records.import_records(client2, "empo2", records)
    runs = comparison_runs.select_runs(client2, None, run_ids=[store["ids"]["grpo1"], store["ids"]["empo1"]])
    assert sorted(r.info.run_id for r in runs) == sorted(imported)
    client2.delete_run(runs[0].info.run_id)
    assert run_records.import_records(client2, "empo2", records) == []
    with pytest.raises(ValueError, match="no run 'nope' in this store"):
        comparison_runs.select_runs(client2, None, run_ids=["nope"])
    twin = _log_run(store["client"], store["exp_id"], "grpo", 1, [(0, 1, 0, 5.0)])
    with pytest.raises(ValueError, match=r"share algorithm and seed \{'grpo-seed1'"):
        compare_runs.main(["--tracking-uri", store["uri"], "--run-ids", store["ids"]["grpo1"], twin,
                           "--out-dir", str(tmp / "twins"), "--no-log"])
    assert not (tmp / "twins").exists()


def test_no_log_writes_files_only(store):
    out = store["tmp"] / "nolog"
    result = compare_runs.main(["--tracking-uri", store["uri"], "--run-ids", store["ids"]["grpo1"],
                                store["ids"]["empo1"], "--out-dir", str(out), "--no-log"])
    assert result["comparison_run_id"] is None and (out / "learning_curves_wallclock.png").exists()
    assert len(store["client"].search_runs([store["exp_id"]])) == 6


def test_study_dry_run_prints_plan(tmp_path, capsys):
    uri = f"logger.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db"
    assert run_study.main(["--seeds", "1", "2", "--iterations", "3", "--study-id", "t1",
                           "--minutes-per-iteration", "2.5", "--dry-run", "model=tiny", uri]) == 0
    out = capsys.readouterr().out
    lines = [ln.strip() for ln in out.splitlines() if "train.py" in ln]
    assert len(lines) == 4 and lines[0].endswith(
        "experiment=scienceworld algorithm=grpo seed=1 trainer.max_epochs=3 tags=[scienceworld,cpu,study-t1] "
        "model=tiny " + uri)
    assert "algorithm=empo2 seed=2" in lines[3]
    # no earlier runs in this store: (0.5 min start-up + 2.5 min x 3 iterations) x 2 seeds x 2 algorithms
    assert "--tag study-t1" in out and "Estimated total: 32 min" in out
    # the comparison takes every algorithm of the study, also those another invocation ran
    assert "--algorithms" not in out.split("then: python scripts/compare_runs.py")[1]


def test_a_study_decides_the_precisions_once_for_all_its_runs(tmp_path, monkeypatch, capsys):
    """``auto`` precisions are timed probes; the study probes once and its runs inherit the choice (two runs of one
    study had once chosen different rollout precisions under different loads): trainer.precision through the
    environment, the rollout precision on each run's command line."""
    import os

    from src.models import rollout_engine

    monkeypatch.delenv("EMPO2_PRECISION_CHOICE", raising=False)
    monkeypatch.setattr(rollout_engine, "_CHOSEN", {})  # this process has not chosen yet: the study probes
    seen = []
    monkeypatch.setattr(run_study, "run_all", lambda commands, parallel, threads: seen.append(
        (os.environ.get("EMPO2_PRECISION_CHOICE"), commands)) or [])
    monkeypatch.setattr(run_study.subprocess, "run", lambda *a, **k: None)  # the comparison afterwards
    assert run_study.main(["--seeds", "1", "--iterations", "1", "--study-id", "p", "model=tiny",
                           "model.warm_start=null", f"logger.mlflow.tracking_uri=sqlite:///{tmp_path}/m.db"]) == 0
    (trainer, commands), = seen
    rollout = {a for cmd in commands for a in cmd if a.startswith("model.policy.rollout_precision=")}
    assert trainer and trainer.startswith("cpu|") and commands and len(rollout) == 1
    assert all(sum(a.startswith("model.policy.rollout_precision=") for a in cmd) == 1 for cmd in commands)
    rollout = rollout.pop().split("=")[1]
    assert rollout in rollout_engine.ROLLOUT_PRECISIONS and rollout != "auto"
    assert f"precision of every run: trainer {trainer.split('|')[1]}, rollout {rollout}" in capsys.readouterr().out


def test_study_refuses_side_by_side_runs_that_do_not_fit_in_memory(tmp_path, capsys):
    """Known answers: 90% of 24 GiB holds one 10.9-GiB run (two WebShop runs were killed for memory), four 5-GiB
    runs. run_study reads the peak from any earlier run of the experiment, a failed one included."""
    with pytest.raises(ValueError, match="--parallel 2: .* 10.9 GiB .* expected --parallel 1 or less"):
        run_study.check_parallel_fits(2, 10.9, 24.0)
    assert "5.0 GiB each; 4 side by side fit" in run_study.check_parallel_fits(4, 5.0, 24.0)
    assert "no earlier run" in run_study.check_parallel_fits(2, None, 24.0)
    uri = f"sqlite:///{tmp_path}/m.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("empo2", artifact_location=str(tmp_path / "mlartifacts"))
    cfg = run_study.compose("scienceworld", ["algorithm=grpo", "model=tiny"])
    rid = _log_run(client, exp_id, "grpo", 1, [(0, 1, 0, 10.0)], status="FAILED")
    client.log_batch(rid, metrics=[Metric("system/peak_rss_gib", 1000.0, T0, 0)],
                     params=[Param("model/policy/name_or_path", cfg.model.policy.name_or_path)])
    args = ["--seeds", "1", "--iterations", "1", "--dry-run", "--parallel", "2", "model=tiny",
            f"logger.mlflow.tracking_uri={uri}"]
    with pytest.raises(SystemExit):
        run_study.main(args)
    assert "1000.0 GiB each" in capsys.readouterr().err
    assert run_study.main([*args[:6], "1", *args[7:]]) == 0  # one at a time: nothing to refuse


def test_study_commands_compose():
    """The generated overrides (tags list with the study tag) are valid Hydra overrides."""
    cmd = run_study.run_commands("scienceworld", ["grpo"], [7], 5, ["scienceworld", "cpu", "study-x"],
                                 ["model=tiny"])[0]
    cfg = run_study.compose("scienceworld", cmd[3:])
    assert (cfg.algorithm.name, cfg.seed, cfg.trainer.max_epochs) == ("grpo", 7, 5)
    assert list(cfg.tags) == ["scienceworld", "cpu", "study-x"]


@pytest.mark.slow  # ~45 s on 2 idle cores (90 s under load): two JVM-backed training runs
def test_two_real_training_runs(tmp_path):
    """src.train.train writes one EMPO² and one GRPO run (tiny policy, real ScienceWorld, 2 iterations each) to a
    fresh store; the comparison reads them back point for point and logs its figures."""
    from hydra import compose, initialize_config_dir

    from src.train import train

    base = ["experiment=scienceworld", "model=tiny", "model.warm_start=null", f"paths.log_dir={tmp_path}/logs", "data.tasks_per_iteration=1",
            "data.group_size=2", "env.max_steps=3", "data.micro_batch_size=2",
            "data.val.num_tasks=1", "data.max_response_tokens=6", "memory.tip_max_tokens=8",
            "~callbacks.rich_progress_bar", "trainer.enable_progress_bar=false", "trainer.max_epochs=2"]
    run_ids = {}
    for algo in ("empo2", "grpo"):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose(config_name="train",
                          overrides=[*base, f"algorithm={algo}", f"paths.output_dir={tmp_path}/{algo}"])
        run_ids[algo] = train(cfg)["loggers"][0].run_id
    uri = cfg.logger.mlflow.tracking_uri
    out = tmp_path / "cmp"
    result = compare_runs.main(["--tracking-uri", uri, "--tag", "scienceworld", "--out-dir", str(out)])
    assert sorted(result["runs"]) == sorted(run_ids.values())
    client = mlflow.MlflowClient(tracking_uri=uri)
    report = json.loads((out / "curves.json").read_text())
    for algo, rid in run_ids.items():
        logged = [m.value for m in sorted(client.get_metric_history(rid, "rollout/score"), key=lambda m: m.step)]
        curve = report["curves"][algo]["rollout/score"]
        assert curve["iteration"] == [0, 1] and curve["mean"] == pytest.approx(logged) and curve["n"] == [1, 1]
        # check_val_every_n_epoch=2: one validation, after iteration 1, i.e. of the policy after 2 iterations
        val = report["curves"][algo]["val/score"]
        assert val["iteration"] == [2]
        assert val["mean"] == pytest.approx([client.get_run(rid).data.metrics["val/score"]])
        assert 0 < curve["minutes"][0] < curve["minutes"][1] < val["minutes"][0]
    for name in ("learning_curves_iteration.png", "learning_curves_wallclock.png"):
        assert _read_png(out / name).shape[:2] == CURVE_PX
    artifacts = {a.path for a in client.list_artifacts(result["comparison_run_id"])}
    assert artifacts == {"learning_curves_iteration.png", "learning_curves_wallclock.png", "curves.json", "results.md",
                         "iterations.md", "paired.md", "paired.json", "runs"}
    # the per-episode files came back from the runs; their pair is the difference of the logged validation scores
    assert sorted(f.name.split("-seed")[0] for f in (out / "episodes").glob("*.csv")) == ["empo2", "grpo"]
    paired = json.loads((out / "paired.json").read_text())["empo2-grpo"]
    val_score = {algo: client.get_run(rid).data.metrics["val/score"] for algo, rid in run_ids.items()}
    assert paired["seed_level"]["mean"] == pytest.approx(val_score["empo2"] - val_score["grpo"])
    assert paired["paired_by_episode"]["mean"] == pytest.approx(paired["seed_level"]["mean"])
    rows = (out / "iterations.md").read_text().splitlines()[2:]  # 2 iterations per run, each with its drawn mode
    assert len(rows) == 4 and all(any(f" | {m} | " in r for m in ("on_policy", "off_policy", "on_policy_with_tips"))
                                  for r in rows)
    # a new session's empty store: the run records bring both runs back, with the same tables and pairs
    before = {name: (out / name).read_text() for name in ("results.md", "iterations.md", "paired.json")}
    again = compare_runs.main(["--tracking-uri", f"sqlite:///{tmp_path}/fresh.db", "--tag", "scienceworld",
                               "--out-dir", str(out), "--no-log"])
    assert len(again["runs"]) == 2 and {name: (out / name).read_text() for name in before} == before
    fresh = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/fresh.db")  # artifacts beside the store
    assert {r.info.artifact_uri.split("://")[-1].startswith(str(tmp_path))
            for r in fresh.search_runs([e.experiment_id for e in fresh.search_experiments()])} == {True}
