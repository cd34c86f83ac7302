"""Merge the arms of two adaptation runs of the same evaluation into one summary.

    python src/eval.py ... eval.protocol=adaptation eval.control=true eval.summary_file=own_vs_off.json
    python src/eval.py ... eval.protocol=adaptation eval.own_tips=false eval.oracle_tips=true eval.empty_tips=true \
        eval.summary_file=oracle_empty.json          # the same command otherwise: same weights, tasks, seeds, trials
    python scripts/merge_adaptation.py own_vs_off.json oracle_empty.json --out four_arms.json
    python scripts/adaptation_report.py WebShop=four_arms.json --out-dir ...

Refuses runs that are not the same evaluation (another policy hash, tasks, seeds, trials or temperature) or whose
trial 0 is other episodes (other sampling streams), naming the first difference; the paired differences to the
memory-off control are recomputed from the episodes (studies/merge_arms.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from studies.merge_arms import merge_arms  # noqa: E402
from src.utils.io import write_text_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the summary whose arms are kept (with the memory-off control)")
    parser.add_argument("extra", type=Path, help="the summary whose other arms are added")
    parser.add_argument("--out", type=Path, required=True, help="where the merged summary is written")
    args = parser.parse_args(argv)
    base, extra = (json.loads(p.read_text()) for p in (args.base, args.extra))
    merged = merge_arms(base, extra, str(args.base), str(args.extra))
    write_text_atomic(args.out, json.dumps(merged, indent=2) + "\n")
    added = sorted(set(merged["episode_rows"]) - set(base["episode_rows"]))
    print(f"{args.out}: arms {sorted(merged['episode_rows'])} (added {added} from {args.extra})")
    for arm, paired in (merged.get("paired_vs_off") or {}).items():
        d = paired[-1]["score_diff"]
        stderr = "n/a" if d["stderr"] is None else f"{d['stderr']:.3f}"
        print(f"  {arm} - off at trial {paired[-1]['trial']}: {d['mean']:+.3f} +- {stderr} (n={d['n']})")


if __name__ == "__main__":
    main()
