"""Every command of README.md and docs/*.md that trains, evaluates or exports (``python src/{train,eval,export}.py``)
is a test, so a documented command cannot rot:

- each one's config composes as written and passes the settings checks of its entry point (all of them, here);
- the quick start runs as the README and docs/evaluation.md and docs/export.md write it: ``experiment=smoke``, then
  ``src/eval.py`` and ``src/export.py`` with nothing but the checkpoint, then the exported agent evaluated (here);
- each one runs at the smallest size that still executes it (``-m slow``): a tiny policy, one iteration of one
  group, two actions per episode, on the CPU, with the quick start's checkpoint and agent standing in for ``<run>``.

Placeholders are replaced as a reader would (``<run>``/``...`` by a checkpoint, ``agent`` by an exported agent,
``<name>`` by ``coin``, ``$algo`` by ``empo2``, ``<id>`` by an MLflow run id, ``WEBSHOP_DATA_DIR=...`` dropped: the
generated catalog stands in); a new placeholder fails ``test_the_docs_hold_runnable_commands``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"python src/(train|eval|export)\.py((?:[ \t]+[^\s`#;]+)*)")
# the smallest size that still executes a command: on the CPU, a tiny policy, one iteration of one group of two
SHRINK = {
    "train": ["model=tiny", "model.warm_start=null", "trainer=default", "trainer.max_epochs=1",
              "trainer.check_val_every_n_epoch=1", "data.tasks_per_iteration=1", "data.group_size=2",
              "data.micro_batch_size=2", "data.num_mini_batches=1", "data.mini_batch_rows=null",
              "data.max_response_tokens=4", "data.val.num_tasks=1", "data.val.episodes_per_task=1", "env.max_steps=2",
              "memory.tip_max_tokens=8", "model.policy.max_prompt_tokens=1024"],
    "eval": ["model.warm_start=null", "trainer=default", "eval.num_tasks=1", "eval.episodes_per_task=1",
             "eval.trials=1", "env.max_steps=2", "data.max_response_tokens=4", "memory.tip_max_tokens=8"],
    "export": [],
}


def doc_commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """``(where, script, arguments)`` of each distinct documented command; commands whose arguments elide the rest
    (a bare ``...``) and those that only print the config (Hydra's own ``--cfg`` flags) are left out."""
    seen, found = set(), []
    for path in DOCS:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # a shell line continued with a backslash
        for number, line in enumerate(text.splitlines(), 1):
            for match in _COMMAND.finditer(line):
                args = tuple(match.group(2).split())
                if "..." in args or any(a.startswith("--") for a in args) or (match.group(1), args) in seen:
                    continue
                seen.add((match.group(1), args))
                found.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), args))
    return found


def runnable(args: tuple[str, ...], ckpt: str, agent: str, out: str, run_id: str) -> list[str]:
    """The arguments with the placeholders replaced (see the module doc)."""
    result = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "ckpt_path" and value not in ("null", ""):
            value = ckpt
        elif key == "model.policy.name_or_path" and value == "agent":
            value = agent
        elif key == "eval.memory_file":
            value = value.replace("agent", agent, 1)
        elif key == "export.out_dir":
            value = out
        value = value.replace("$algo", "empo2").replace("<name>", "coin").replace("<id>", run_id)
        result.append(f"{key}={value}" if _ else key)
    return result


COMMANDS = doc_commands()


def test_the_docs_hold_runnable_commands():
    assert len(COMMANDS) >= 25, COMMANDS  # the extraction found the docs' commands
    assert {script for _, script, _ in COMMANDS} == {"train", "eval", "export"}
    left = [(where, a) for where, _, args in COMMANDS for a in runnable(args, "C", "A", "O", "1") if "<" in a or "$" in a]
    assert left == [], f"a placeholder this test cannot fill: {left}"


def _compose(script: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=script, overrides=overrides)


@pytest.mark.parametrize("where, script, args", COMMANDS, ids=[f"{w} {s} {' '.join(a)}" for w, s, a in COMMANDS])
def test_a_documented_command_composes_and_passes_its_settings_checks(tmp_path, where, script, args):
    """The command as written (placeholders filled): its config composes and its settings are accepted; what needs
    the GPU or the paper's weights is left to the run (``-m slow``: at the smallest size)."""
    from src.config_checks import check_training_settings
    from src.evaluation.protocols import check_eval_config

    overrides = runnable(args, str(tmp_path / "last.ckpt"), str(tmp_path / "agent"), str(tmp_path / "out"), "0")
    cfg = _compose(script, overrides + [f"paths.log_dir={tmp_path}", f"paths.output_dir={tmp_path}/run"])
    if script == "train":
        check_training_settings(cfg)
    elif script == "eval":
        check_eval_config(cfg.eval)
    else:
        assert cfg.export.out_dir, where


def _run(script: str, args: list[str], log_dir: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", **env}
    done = subprocess.run([sys.executable, f"src/{script}.py", *args, f"paths.log_dir={log_dir}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"python src/{script}.py {' '.join(args)}\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
    return done


def _last_run(logs: Path) -> tuple[str, str]:
    """(the checkpoint, the MLflow run id) of the one training run under ``logs``."""
    import mlflow

    run_dir, = (logs / "train" / "runs").iterdir()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{logs}/mlflow.db")
    run, = client.search_runs([client.get_experiment_by_name("empo2").experiment_id])
    return str(run_dir / "checkpoints" / "last.ckpt"), run.info.run_id


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> dict:
    """README's first command as written (``python src/train.py experiment=smoke``) and docs/export.md's export of
    its checkpoint with nothing else named: the ``<run>`` and the ``agent`` of the other commands."""
    logs = tmp_path_factory.mktemp("quick_start")
    smoke = _run("train", ["experiment=smoke"], logs, EMPO2_DATA_DIR=str(logs / "data"))  # from an empty data dir
    ckpt, run_id = _last_run(logs)
    _run("export", [f"ckpt_path={ckpt}", f"export.out_dir={logs / 'agent'}"], logs)
    return {"logs": logs, "ckpt": ckpt, "run_id": run_id, "agent": str(logs / "agent"), "smoke": smoke}


def test_the_first_run_prints_what_the_readme_shows_and_converts_nothing_it_does_not_use(quick_start):
    """README "A first run": the run directory, then one line per iteration, on stderr the cut replies only; of the
    embedded models only the tiny policy is built (SmolLM2's weights are not converted for it)."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", quick_start["smoke"].stdout).splitlines()
    assert len(lines) == 3 and "Run directory: " in lines[0], lines
    assert "iteration 0 (on_policy): score" in lines[1] and "iteration 1 (on_policy_with_tips): score" in lines[2]
    # the random policy never ends a reply: the one warning says they are cut at the cap (rollout/replies_cut_frac)
    stderr = [line for line in quick_start["smoke"].stderr.splitlines() if line.strip()]
    assert len(stderr) == 2 and "replies were cut at data.max_response_tokens=8" in stderr[0], stderr
    import mlflow  # and the tracker has the share per iteration, replies and reflections

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{quick_start['logs']}/mlflow.db")
    replies = client.get_metric_history(quick_start["run_id"], "rollout/replies_cut_frac")
    assert sorted((m.step, m.value) for m in replies) == [(0, 1.0), (1, 1.0)]
    tips = client.get_metric_history(quick_start["run_id"], "rollout/tips_cut_frac")
    assert sorted(m.step for m in tips) == [0, 1] and all(0.0 <= m.value <= 1.0 for m in tips)
    assert sorted(p.name for p in (quick_start["logs"] / "data" / "models").iterdir()) == ["tiny-random-llama"]


def test_the_quick_start_evaluates_and_exports_with_nothing_but_the_checkpoint(quick_start):
    """docs/evaluation.md and docs/export.md: ``src/eval.py`` and ``src/export.py`` take the training run's settings
    from its checkpoint (a smoke run: the tiny policy, its ScienceWorld task and action cap), no experiment named;
    then docs/export.md's evaluation of the exported agent."""
    logs, ckpt, agent = quick_start["logs"], quick_start["ckpt"], quick_start["agent"]
    info = json.loads((Path(agent) / "export_info.json").read_text())
    assert info["base_model"] == "embedded:tiny-random-llama" and info["memory"]["num_entries"] > 0
    out = _run("eval", [f"ckpt_path={ckpt}", f"eval.summary_file={logs}/eval.json"], logs).stdout
    summary = json.loads((logs / "eval.json").read_text())
    assert summary["model"] == "embedded:tiny-random-llama" and "Settings of the checkpoint's training run" in out
    assert summary["num_tasks"] == 1  # the smoke run's data.val.num_tasks, through eval.num_tasks' interpolation
    _run("eval", ["experiment=scienceworld", "ckpt_path=null", "model.warm_start=null",
                  f"model.policy.name_or_path={agent}", f"eval.memory_file={agent}/memory", "eval.num_tasks=1",
                  "env.max_steps=2"], logs)


@pytest.mark.slow
@pytest.mark.parametrize("where, script, args", COMMANDS, ids=[f"{w} {s} {' '.join(a)}" for w, s, a in COMMANDS])
def test_a_documented_command_runs_at_the_smallest_size(quick_start, tmp_path, where, script, args):
    """A training command that resumes (``ckpt_path``) first trains its own configuration, so the checkpoint and
    the MLflow run it resumes are its own; the base model of an evaluation (``ckpt_path=null``) is the tiny one."""
    ckpt, run_id = quick_start["ckpt"], quick_start["run_id"]
    if script == "train" and any(a.startswith("ckpt_path=") for a in args):
        first = [a for a in args if not a.startswith(("ckpt_path=", "+logger.mlflow.run_id="))]
        _run(script, runnable(tuple(first), ckpt, "", "", run_id) + SHRINK[script], tmp_path / "first")
        ckpt, run_id = _last_run(tmp_path / "first")
    overrides = runnable(args, ckpt, quick_start["agent"], str(tmp_path / "out"), run_id)
    base_model = script == "eval" and "ckpt_path=null" in args and "model.policy.name_or_path=agent" not in args
    logs = tmp_path / "first" if script == "train" and "+logger.mlflow.run_id=<id>" in args else tmp_path
    _run(script, overrides + SHRINK[script] + (["model=tiny"] if base_model else []), logs)
