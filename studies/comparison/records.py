"""Run records: one training run's MLflow data as a JSON file, so that a study can go on in another store.

A study's runs can span sessions and machines, each with its own MLflow store (``logs/`` is not committed), and a
comparison made in the last store would see only the runs made there. ``scripts/compare_runs.py`` therefore writes a
record of every run it compares to ``<out-dir>/runs/<algorithm>-seed<seed>.json`` and, before it selects runs,
imports the records of that directory whose runs its store lacks. An imported run carries its original run id in
the tag ``RECORD_SOURCE_TAG``; its record is written back with that id, so a record read into a store and written
out again is the same file.

A record holds what the comparison reads: the run's name, status, start and end time (ms since the epoch), its
parameters and tags, and the full history of every metric as ``[step, timestamp (ms), value]`` rows. The per-episode
validation file (``validation_episodes.csv``) is not in the record: it is the study's
``episodes/<algorithm>-seed<seed>.csv``, which the import logs back as the run's artifact.
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Sequence

import mlflow
from mlflow.entities import Metric, Param, Run, RunTag, ViewType

from studies.episode_table import FILE as EPISODE_FILE
from src.utils.io import write_text_atomic

RECORD_VERSION = 1
RECORD_SOURCE_TAG = "empo2.record_source"  # run id of the run an imported record was written from
IMPORTING_TAG = "empo2.record_importing"  # on a run while its import is under way
# MLflow's limits per log_batch request (1000 entities in all, of which at most 100 params and 100 tags)
_BATCH = {"metrics": 1000, "params": 100, "tags": 100}

log = logging.getLogger(__name__)


def original_run_id(run: Run) -> str:
    """The id of the run as first logged: the record's source for an imported run, else its own id."""
    return run.data.tags.get(RECORD_SOURCE_TAG, run.info.run_id)


def record_name(run: Run) -> str:
    """``<algorithm>-seed<seed>``: the file name (without ``.json``) shared with the run's episodes CSV."""
    return f"{run.data.params['algorithm/name']}-seed{int(run.data.params.get('seed', 0))}"


def run_record(client: mlflow.MlflowClient, run: Run) -> dict[str, Any]:
    """The record of ``run`` (module docstring); metric rows sorted by step, timestamp and value (its text, so that
    a NaN sorts the same whatever order the store returns the rows in)."""
    metrics = {}
    for key in sorted(run.data.metrics):
        history = client.get_metric_history(run.info.run_id, key)
        metrics[key] = sorted(([m.step, m.timestamp, m.value] for m in history),
                              key=lambda row: (row[0], row[1], repr(row[2])))
    return {"record_version": RECORD_VERSION, "run_id": original_run_id(run), "run_name": run.info.run_name,
            "status": run.info.status, "start_time": run.info.start_time, "end_time": run.info.end_time,
            "params": dict(sorted(run.data.params.items())),
            "tags": {k: v for k, v in sorted(run.data.tags.items()) if k != RECORD_SOURCE_TAG},
            "metrics": metrics}


def record_names(runs: Sequence[Run]) -> list[str]:
    """``record_name`` of each run.

    Raises:
        ValueError: two runs share an algorithm and a seed (their records and episode files would overwrite each
            other); names them.
    """
    names = [record_name(r) for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        ids = {n: [original_run_id(r) for r in runs if record_name(r) == n] for n in dup}
        raise ValueError(f"two runs share algorithm and seed {ids}: select one of each (--run-ids)")
    return names


def write_records(client: mlflow.MlflowClient, runs: Sequence[Run], directory: Path) -> list[Path]:
    """Write each run's record to ``directory/<algorithm>-seed<seed>.json`` (atomically); return the paths.

    Raises:
        ValueError: two runs share an algorithm and a seed (``record_names``).
    """
    paths = []
    for run, name in zip(runs, record_names(runs)):
        paths.append(Path(directory) / f"{name}.json")
        write_text_atomic(paths[-1], _dumps(run_record(client, run)))
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


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _runs_by_original_id(client: mlflow.MlflowClient) -> dict[str, list[Run]]:
    """Every run of every experiment of the store, deleted ones included, by ``original_run_id``."""
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    out: dict[str, list[Run]] = {}
    for run in client.search_runs(experiments, run_view_type=ViewType.ALL, max_results=50000) if experiments else []:
        out.setdefault(original_run_id(run), []).append(run)
    return out


def _create_run(client: mlflow.MlflowClient, exp_id: str, record: dict[str, Any], csv: Path | None) -> str:
    """A run holding ``record`` (and ``csv`` as its ``validation_episodes.csv``). It carries ``IMPORTING_TAG``
    until it is complete: an import stopped halfway (even by a signal) leaves a run that the next import deletes,
    never one that passes for the record's run."""
    run = client.create_run(exp_id, start_time=record["start_time"], run_name=record["run_name"],
                            tags={IMPORTING_TAG: record["run_id"]})
    rid = run.info.run_id
    try:
        metrics = [Metric(key, value, timestamp, step)
                   for key, rows in record["metrics"].items() for step, timestamp, value in rows]
        params = [Param(k, v) for k, v in record["params"].items()]
        tags = [RunTag(k, v) for k, v in record["tags"].items()]
        for kind, items in (("metrics", metrics), ("params", params), ("tags", tags)):
            for i in range(0, len(items), _BATCH[kind]):
                client.log_batch(rid, **{kind: items[i:i + _BATCH[kind]]})
        if csv is not None and csv.exists():
            with tempfile.TemporaryDirectory() as tmp:
                staged = Path(tmp) / EPISODE_FILE
                staged.write_bytes(csv.read_bytes())
                client.log_artifact(rid, str(staged))
        client.set_tag(rid, RECORD_SOURCE_TAG, record["run_id"])
        client.delete_tag(rid, IMPORTING_TAG)
        if record["end_time"] is None:  # still running when recorded: no end time (set_terminated would add now)
            client.update_run(rid, status=record["status"])
        else:
            client.set_terminated(rid, status=record["status"], end_time=record["end_time"])
    except BaseException:
        client.delete_run(rid)
        raise
    return rid


def import_records(client: mlflow.MlflowClient, experiment: str, directory: Path,
                   episodes_dir: Path | None = None) -> list[str]:
    """Bring the runs recorded in ``directory`` into the store; returns the ids of the runs created.

    Per record: nothing when the store holds the original run (the store is the newer account) or an imported copy
    equal to the record; a copy that differs (the run went on after an earlier record, e.g. one taken while it was
    RUNNING) is replaced; a run deleted from this store is left out (delete its record file to drop it from the
    study for good); otherwise a run is created in ``experiment`` (made if missing, its artifacts beside a sqlite
    store), with ``episodes_dir/<algorithm>-seed<seed>.csv``, where it exists, as its ``validation_episodes.csv``.
    Runs of an import that was stopped halfway are deleted first.

    Raises:
        ValueError: a file of ``directory`` is not a run record (``read_record``).
    """
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(
        experiment, artifact_location=artifact_location(client.tracking_uri))
    existing = _runs_by_original_id(client)
    for runs in existing.values():
        for run in runs:
            if IMPORTING_TAG in run.data.tags and run.info.lifecycle_stage == "active":
                client.delete_run(run.info.run_id)
    created = []
    for path in sorted(Path(directory).glob("*.json")):
        record = read_record(path)
        runs = [r for r in existing.get(record["run_id"], []) if IMPORTING_TAG not in r.data.tags]
        active = [r for r in runs if r.info.lifecycle_stage == "active"]
        if runs and not active:
            log.info("run record %s: its run was deleted from this store, left out", path.name)
            continue
        if active:
            copy = active[0]
            if RECORD_SOURCE_TAG not in copy.data.tags or _dumps(run_record(client, copy)) == _dumps(record):
                continue
            log.info("run record %s differs from its imported copy (the run went on): replacing it", path.name)
            client.delete_run(copy.info.run_id)
        name = f"{record['params'].get('algorithm/name')}-seed{int(record['params'].get('seed', 0))}"
        csv = Path(episodes_dir) / f"{name}.csv" if episodes_dir is not None else None
        rid = _create_run(client, exp_id, record, csv)
        existing[record["run_id"]] = [client.get_run(rid)]
        created.append(rid)
    return created
