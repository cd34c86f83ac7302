"""Reading the adaptation summaries that ``src/eval.py eval.protocol=adaptation`` writes (``eval_summary.json``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from studies.comparison.runs import ALGORITHM_LABELS

ROOT = Path(__file__).resolve().parents[3]


def environment_of_target(target: str | None):
    """The ``Environment`` class an environment's ``_target_`` names, or None (no target, or one this checkout cannot
    import)."""
    from src.envs.base import environment_class

    try:
        return environment_class(target) if target else None
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


def _adaptation_label(doc: dict, path: Path) -> str:
    """``label``/``algorithm`` of the summary, else the algorithm of the training run that wrote ``ckpt_path``
    (its Hydra ``.hydra/config.yaml`` two levels above the checkpoint), else the file's directory name."""
    algo = doc.get("label") or doc.get("algorithm")
    if isinstance(algo, dict):
        algo = algo.get("name")
    if not algo and "ckpt_path" in doc:
        if not doc["ckpt_path"]:
            return "base model (untrained)"
        ckpt = Path(doc["ckpt_path"])
        for run_dir in (ckpt.parent.parent, ROOT / ckpt.parent.parent):
            if (run_dir / ".hydra" / "config.yaml").is_file():
                from omegaconf import OmegaConf

                algo = OmegaConf.load(run_dir / ".hydra" / "config.yaml").get("algorithm", {}).get("name")
                break
    return ALGORITHM_LABELS.get(str(algo), str(algo)) if algo else path.parent.name or path.stem


def load_adaptation(specs: Sequence[str | Path]) -> dict[str, dict[str, Any]]:
    """Read adaptation summaries (``eval_summary.json`` of ``src/eval.py`` with ``eval.protocol=adaptation``).

    ``specs``: paths, or ``LABEL=PATH`` to name the curve. Per-trial scores come from ``trials`` (a list of
    objects with ``score`` and optionally ``score_stderr``, as src/eval.py writes) or ``trial_scores`` (a list of
    numbers, or of per-episode score lists that are averaged), at the top level or under ``summary``. Trial 0 is
    the no-memory trial. Without ``LABEL=`` the label is found by ``_adaptation_label``; files with one label are
    averaged. Returns ``{label: {"scores": array (n_files, n_trials), "stderr": array (n_trials,) or None
    (a single file's per-trial standard error over its episodes), "env", "task", "files"}}``.

    Raises ValueError naming the file when it has no per-trial scores or files with one label disagree on the
    number of trials.
    """
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        spec = str(spec)
        # an existing path wins: Hydra multirun directories contain '=' themselves
        if Path(spec).exists() or "=" not in spec:
            label, path = "", Path(spec)
        else:
            label, rest = spec.split("=", 1)
            path = Path(rest)
        doc = json.loads(path.read_text())
        found = None
        for scope in (doc, doc.get("summary")):
            if isinstance(scope, dict) and (found := _trial_scores(scope)) is not None:
                break
        if found is None:
            raise ValueError(f"{path}: no per-trial scores; expected 'trials': [{{'score': ...}}, ...] (src/eval.py "
                             f"eval.protocol=adaptation) or 'trial_scores': [...] (keys found: {sorted(doc)})")
        scores, stderr = found
        label = label or _adaptation_label(doc, path)
        entry = out.setdefault(label, {"scores": [], "stderr": stderr, "env": doc.get("env"),
                                       "task": doc.get("task"), "files": []})
        if entry["scores"] and len(entry["scores"][0]) != len(scores):
            raise ValueError(f"{path}: {len(scores)} trials, but {entry['files'][0]} (same label {label!r}) has "
                             f"{len(entry['scores'][0])}")
        entry["scores"].append(scores)
        entry["files"].append(str(path))
    for entry in out.values():
        single = len(entry["scores"]) == 1 and entry["stderr"] is not None  # a single file's own standard errors
        entry["scores"] = np.asarray(entry["scores"], dtype=float)
        entry["stderr"] = np.asarray(entry["stderr"], dtype=float) if single else None
    return out


def _trial_scores(scope: dict) -> tuple[list[float], list[float] | None] | None:
    """(per-trial scores, per-trial standard errors or None) from one JSON object, None if it has neither."""
    trials = scope.get("trials")
    if isinstance(trials, list) and trials and all(isinstance(t, dict) and "score" in t for t in trials):
        stderr = [t.get("score_stderr") for t in trials]
        return ([float(t["score"]) for t in trials],
                None if any(s is None for s in stderr) else [float(s) for s in stderr])
    if isinstance(scope.get("trial_scores"), list):
        return [float(np.mean(s)) if isinstance(s, list) else float(s) for s in scope["trial_scores"]], None
    return None
