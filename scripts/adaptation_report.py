"""Report adaptation runs with a memory-off control: one PNG, a Markdown table, tip statistics.

    python src/eval.py experiment=webshop eval.protocol=adaptation eval.control=true eval.trials=3 ... \
        eval.summary_file=docs/results/adaptation/webshop.json
    python scripts/adaptation_report.py WebShop=docs/results/adaptation/webshop.json \
        ScienceWorld=docs/results/adaptation/scienceworld.json --out-dir docs/results/adaptation

Reads the summaries `src/eval.py` writes with `eval.protocol=adaptation eval.control=true` (per-trial rows of both
arms, the paired per-episode difference memory − control, the reflections written) and writes to `--out-dir`:

- `adaptation_control.png`: score per trial (mean ± s.e. over episodes), with memory and without (and the oracle and
  placeholder-tips arms where the summary has them: `eval.oracle_tips`, `eval.empty_tips`), one panel per
  environment;
- `report.md`: per trial both arms' score and success and the paired difference (mean ± s.e.), the diagnostic arms'
  scores and their paired difference to the control; per arm and trial the steps per episode (and on WebShop the
  episodes that click `buy now` before any product); the share of
  reflections that are action replies (`is_action_reply`: an `<action>` tag, or one bare command) and the
  share that name something the next attempt can use (`usable_tip`); ten reflections quoted verbatim per environment.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.envs.base import is_action_reply  # noqa: E402
from studies.comparison.adaptation import environment_of_target  # noqa: E402

STOP = set("""a an the and or of in on to for with that is it its i i'm i'd im need want looking some be me get
buy find would like please this my your you which have has also than lower price dollars choose size color style
from at by as are was""".split())
SCIENCEWORLD_ROOMS = ("kitchen", "bedroom", "hallway", "workshop", "greenhouse", "art studio", "living room",
                      "bathroom", "foundry", "outside")


def usable_tip(tip: str, instruction: str, env: str, bare_command=None) -> bool:
    """Whether a reflection names something the next attempt can use, and is not an action reply.

    WebShop: a ``search[...]`` query of two or more words, or a content word of the instruction (an option value
    such as a colour or size, an attribute, the product's noun; stop words and the price clause excluded).
    ScienceWorld: a room, a box of the instruction ("red box"), or an object acted on (``focus on``/``move``).
    ``bare_command``: the environment's (``Environment.bare_command``), for ``is_action_reply``.
    """
    if is_action_reply(tip, bare_command):
        return False
    low = tip.lower()
    if "webshop" in env.lower():
        if re.search(r"search\[\s*\S+\s+\S+", low):
            return True
        task = re.split(r"and price lower than", instruction.lower())[0]
        words = {w for w in re.findall(r"[a-z0-9][a-z0-9'-]+", task) if w not in STOP}
        return any(re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", low) for w in words)
    box = re.search(r"(\w+ box)", instruction.lower())
    return (any(room in low for room in SCIENCEWORLD_ROOMS) or bool(box and box.group(1) in low)
            or bool(re.search(r"\b(focus on|move) \w+", low)))


def _fmt(mean, stderr, digits: int) -> str:
    if mean is None:
        return "–"
    return f"{mean:.{digits}f} ± {stderr:.{digits}f}" if stderr is not None else f"{mean:.{digits}f}"


def _diagnostic_arms_table(doc: dict, digits: int) -> list[str]:
    """Markdown lines: per trial the oracle / placeholder arms' score and their paired difference to the control
    (``eval.oracle_tips`` / ``eval.empty_tips``); no lines for a summary without them."""
    arms = {k: v for k, v in (doc.get("paired_vs_off") or {}).items() if k != "own"}
    if not arms:
        return []
    names = {"oracle": "oracle tips", "empty": "placeholder tips"}
    lines = ["", "| trial | " + " | ".join(f"{names.get(a, a)}: score | − off" for a in arms) + " |",
             "|---|" + "---|---|" * len(arms)]
    for t in range(len(doc["trials"])):
        cells = []
        for a, paired in arms.items():
            row, d = doc[f"{a}_trials"][t], paired[t]["score_diff"]
            cells += [_fmt(row["score"], row["score_stderr"], digits), _fmt(d["mean"], d["stderr"], digits)]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def buys_before_a_product(episode: dict) -> bool:
    """WebShop: the episode clicks ``buy now`` before it clicks any product (``click[<ASIN>]``, ``B0`` and 8
    letters or digits, as the catalog's ids), i.e. on a page without a buy button, where the click does nothing."""
    for action in episode["actions"]:
        if re.fullmatch(r"click\[b0[a-z0-9]{8}\]", action.lower()):
            return False
        if action.lower() == "click[buy now]":
            return True
    return False


def _behaviour_lines(doc: dict, env: str) -> list[str]:
    """Markdown lines: per arm and trial the steps per episode, and on WebShop the episodes that click ``buy now``
    before any product (``buys_before_a_product``), from the summary's ``episode_rows``."""
    rows = doc.get("episode_rows") or {}
    names = {"control": "memory off", "memory": "own tips", "oracle": "oracle tips", "empty": "placeholder tips"}
    webshop = "webshop" in env.lower()
    lines = ["", "| arm | steps per episode, by trial |" + (" buy now before any product, by trial |" if webshop else ""),
             "|---|---|" + ("---|" if webshop else "")]
    for arm, trials in rows.items():
        steps = ", ".join(f"{sum(e['steps'] for e in eps) / max(len(eps), 1):.1f}" for eps in trials)
        early = ", ".join(f"{sum(map(buys_before_a_product, eps))}/{len(eps)}" for eps in trials)
        lines.append(f"| {names.get(arm, arm)} | {steps} |" + (f" {early} |" if webshop else ""))
    return lines if rows else []


def _plot_arms(ax, label: str, doc: dict, env_cls) -> None:
    """One panel: score per trial (mean ± s.e.) of each arm the summary has (memory on, memory off, and the
    diagnostic arms of ``eval.oracle_tips`` / ``eval.empty_tips``)."""
    for key, name, style in (("trials", "memory on (tips from earlier trials)", "-o"),
                             ("control_trials", "memory off (control)", "--s"),
                             ("oracle_trials", "oracle tips (diagnostic)", "-^"),
                             ("empty_trials", "placeholder tips block", ":v")):
        if key in doc:
            rows = doc[key]
            ax.errorbar([r["trial"] for r in rows], [r["score"] for r in rows],
                        yerr=[r["score_stderr"] or 0 for r in rows], fmt=style, capsize=3, label=name)
    what = doc["task"] or (env_cls.display_name if env_cls else "")
    ax.set_title("\n".join(textwrap.wrap(f"{label}: {what} ({doc['trials'][0]['episodes']} episodes/trial)", 48)),
                 fontsize=10)
    ax.set(xlabel="trial", ylabel=f"score ({env_cls.score_unit})" if env_cls else "score")
    ax.set_xticks([r["trial"] for r in doc["trials"]])
    ax.legend(fontsize=8)


def report(docs: dict[str, dict], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(docs), figsize=(5.2 * len(docs), 3.8), squeeze=False)
    lines = []
    for ax, (label, doc) in zip(axes[0], docs.items()):
        env_cls = environment_of_target(str(doc["env"]))
        digits = 3 if (env_cls.max_score if env_cls else 1.0) <= 1 else 1
        _plot_arms(ax, label, doc, env_cls)
        reflections = doc.get("reflections") or []
        bare = env_cls.bare_command if env_cls else None
        usable = [usable_tip(r["tip"], r["instruction"], str(doc["env"]), bare) for r in reflections]
        actions = [is_action_reply(r["tip"], bare) for r in reflections]
        last = doc["paired"][-1]
        lines += [f"## {label}", "",
                  f"{doc['num_tasks']} held-out tasks × {doc['episodes_per_task']} episode(s) × seeds {doc['seeds']}, "
                  f"T = {doc['temperature']}, trials 0…{len(doc['trials']) - 1}, checkpoint: "
                  f"{doc['ckpt_path'] or 'the warm start (ckpt_path=null)'}.", "",
                  "| trial | memory on: score | memory off: score | paired diff (on − off) | on: success "
                  "| off: success | tip_action_frac |", "|---|---|---|---|---|---|---|"]
        for row, ctrl, diff in zip(doc["trials"], doc["control_trials"], doc["paired"]):
            # recounted from the reflections with today's is_action_reply (older summaries counted tags only)
            written = [is_action_reply(r["tip"], bare) for r in reflections if r.get("trial") == row["trial"]]
            frac = sum(written) / len(written) if written else row.get("tip_action_frac")
            lines.append(f"| {row['trial']} | {_fmt(row['score'], row['score_stderr'], digits)} | "
                         f"{_fmt(ctrl['score'], ctrl['score_stderr'], digits)} | "
                         f"{_fmt(diff['score_diff']['mean'], diff['score_diff']['stderr'], digits)} | "
                         f"{_fmt(row['success_rate'], row['success_rate_stderr'], 2)} | "
                         f"{_fmt(ctrl['success_rate'], ctrl['success_rate_stderr'], 2)} | "
                         f"{'–' if frac is None else f'{frac:.2f}'} |")
        score_diff, success_diff = last["score_diff"], last["success_diff"]
        lines += _diagnostic_arms_table(doc, digits)
        lines += _behaviour_lines(doc, str(doc["env"]))
        lines += ["", "Paired difference at the last trial: "
                  f"**{_fmt(score_diff['mean'], score_diff['stderr'], digits)}**"
                  f" (score, n = {score_diff['n']} pairs), success "
                  f"{_fmt(success_diff['mean'], success_diff['stderr'], 2)}.",
                  f"Reflections written: {len(reflections)}; action replies (an `<action>` tag or one bare command): "
                  f"{sum(actions)} "
                  f"({sum(actions) / max(len(reflections), 1):.1%}); naming something the next attempt can use "
                  f"(`usable_tip`): {sum(usable)} ({sum(usable) / max(len(reflections), 1):.1%}).", "",
                  "Ten reflections, verbatim (the first ten written on trial 0 of the first seed):", ""]
        lines += [f"{k + 1}. (score {r['score']:g}) `{r['tip']}`" for k, r in enumerate(reflections[:10])] + [""]
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "adaptation_control.png", dpi=120)
    text = "\n".join(lines)
    (out_dir / "report.md").write_text(text + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("summaries", nargs="+", help="LABEL=path of an adaptation eval_summary.json with control")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "results" / "adaptation")
    args = parser.parse_args()
    docs = {}
    for spec in args.summaries:
        label, path = spec.split("=", 1) if "=" in spec else (Path(spec).stem, spec)
        doc = json.loads(Path(path).read_text())
        if "control_trials" not in doc:
            raise SystemExit(f"{path}: no control arm; run src/eval.py with eval.control=true")
        docs[label] = doc
    print(report(docs, args.out_dir))


if __name__ == "__main__":
    main()
