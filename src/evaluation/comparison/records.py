"""Run records: one training run's MLflow data as a JSON file, so that a study can go on in another store.

A study's runs can span sessions and machines, each with its own MLflow store (``logs/`` is not committed), and a
comparison made in the last store would see only the runs made there. ``scripts/compare_runs.py`` therefore writes a
record of every run it compares to ``<out-dir>/runs/<algorithm>-seed<seed>.json`` and, before it selects runs,
imports the records of that directory whose runs its store lacks. An imported run carries its original run id in
the tag ``RECORD_SOURCE_TAG``; its record is written back with that id, so records do not change from store to store.

A record holds what the comparison reads: the run's name, status, start and end time (ms since the epoch), its
parameters and tags, and the full history of every metric as ``[step, timestamp (ms), value]`` rows. The per-episode
validation file (``validation_episodes.csv``) is not in the record: it is the study's
``episodes/<algorithm>-seed<seed>.csv``, which the import logs back as the run's artifact.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Sequence

import mlflow
from mlflow.entities import Metric, Param, Run, RunTag

from src.evaluation.episode_table import FILE as EPISODE_FILE
from src.utils.io import write_text_atomic

RECORD_VERSION = 1
RECORD_SOURCE_TAG = "empo2.record_source"  # run id of the run an imported record was written from
# MLflow's limits per log_batch request (1000 entities in all, of which at most 100 params and 100 tags)
_BATCH = {"metrics": 1000, "params": 100, "tags": 100}


def original_run_id(run: Run) -> str:
    """The id of the run as first logged: the record's source for an imported run, else its own id."""
    return run.data.tags.get(RECORD_SOURCE_TAG, run.info.run_id)


def record_name(run: Run) -> str:
    """``<algorithm>-seed<seed>``: the file name (without ``.json``) shared with the run's episodes CSV."""
    return f"{run.data.params['algorithm/name']}-seed{int(run.data.params.get('seed', 0))}"


def run_record(client: mlflow.MlflowClient, run: Run) -> dict[str, Any]:
    """The record of ``run`` (module docstring); metric rows sorted by (timestamp, step, value)."""
    metrics = {}
    for key in sorted(run.data.metrics):
        history = client.get_metric_history(run.info.run_id, key)
        metrics[key] = sorted([m.step, m.timestamp, m.value] for m in history)
    return {"record_version": RECORD_VERSION, "run_id": original_run_id(run), "run_name": run.info.run_name,
            "status": run.info.status, "start_time": run.info.start_time, "end_time": run.info.end_time,
            "params": dict(sorted(run.data.params.items())),
            "tags": {k: v for k, v in sorted(run.data.tags.items()) if k != RECORD_SOURCE_TAG},
            "metrics": metrics}


def write_records(client: mlflow.MlflowClient, runs: Sequence[Run], directory: Path) -> list[Path]:
    """Write each run's record to ``directory/<algorithm>-seed<seed>.json`` (atomically); return the paths.

    Raises:
        ValueError: two runs share an algorithm and a seed (their records would overwrite each other).
    """
    names = [record_name(r) for r in runs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"two runs share algorithm and seed {dup}: select one of each (--run-ids)")
    paths = []
    for run, name in zip(runs, names):
        paths.append(Path(directory) / f"{name}.json")
        write_text_atomic(paths[-1], json.dumps(run_record(client, run), separators=(",", ":")) + "\n")
    return paths


def read_record(path: Path) -> dict[str, Any]:
    """A record written by ``write_records``.

    Raises:
        ValueError: the file is not a run record of this version (names the file and what it holds).
    """
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("record_version") != RECORD_VERSION:
        found = record.get("record_version") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}: expected a run record with record_version {RECORD_VERSION}, found {found!r}")
    missing = [k for k in ("run_id", "run_name", "status", "start_time", "params", "tags", "metrics")
               if k not in record]
    if missing:
        raise ValueError(f"{path}: run record without {missing}")
    return record


def artifact_location(tracking_uri: str) -> str | None:
    """Artifacts beside a local sqlite store (``sqlite:///logs/mlflow.db`` → ``logs/mlartifacts``), as
    configs/logger/mlflow.yaml places them; None (MLflow's default) for any other store. MLflow's own default for a
    sqlite store is ``./mlruns`` under the working directory, which would scatter artifacts wherever the command
    ran."""
    prefix = "sqlite:///"
    if not str(tracking_uri).startswith(prefix):
        return None
    return str((Path(str(tracking_uri)[len(prefix):]).parent / "mlartifacts").resolve())


def _known_run_ids(client: mlflow.MlflowClient, experiment_id: str) -> set[str]:
    runs = client.search_runs([experiment_id], max_results=50000)
    return {original_run_id(r) for r in runs}


def import_records(client: mlflow.MlflowClient, experiment: str, directory: Path,
                   episodes_dir: Path | None = None) -> list[str]:
    """Create in ``experiment`` (made if missing, its artifacts beside a sqlite store) a run for every record in
    ``directory`` whose run the store lacks (neither its id nor an earlier import of it); log
    ``episodes_dir/<name>.csv``, where it exists, as the run's ``validation_episodes.csv``. Returns the ids of the
    runs created (none when every record is known).

    Raises:
        ValueError: a file of ``directory`` is not a run record (``read_record``).
    """
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(
        experiment, artifact_location=artifact_location(client.tracking_uri))
    known = _known_run_ids(client, exp_id)
    created = []
    for path in sorted(Path(directory).glob("*.json")):
        record = read_record(path)
        if record["run_id"] in known:
            continue
        tags = {**record["tags"], RECORD_SOURCE_TAG: record["run_id"]}
        run = client.create_run(exp_id, start_time=record["start_time"], run_name=record["run_name"])
        rid = run.info.run_id
        try:
            metrics = [Metric(key, value, timestamp, step)
                       for key, rows in record["metrics"].items() for step, timestamp, value in rows]
            params = [Param(k, v) for k, v in record["params"].items()]
            tag_list = [RunTag(k, v) for k, v in tags.items()]
            for kind, items in (("metrics", metrics), ("params", params), ("tags", tag_list)):
                for i in range(0, len(items), _BATCH[kind]):
                    client.log_batch(rid, **{kind: items[i:i + _BATCH[kind]]})
            csv = Path(episodes_dir) / f"{path.stem}.csv" if episodes_dir is not None else None
            if csv is not None and csv.exists():
                with tempfile.TemporaryDirectory() as tmp:
                    staged = Path(tmp) / EPISODE_FILE
                    staged.write_bytes(csv.read_bytes())
                    client.log_artifact(rid, str(staged))
        except Exception:
            client.delete_run(rid)  # no half-imported run: the next import tries again
            raise
        client.set_terminated(rid, status=record["status"], end_time=record["end_time"])
        known.add(record["run_id"])
        created.append(rid)
    return created
