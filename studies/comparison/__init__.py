"""Comparing GRPO and EMPO² training runs from an MLflow store (``scripts/compare_runs.py`` is the command line).

- ``runs``: which runs to compare and what they logged, read from MLflow (curves, run facts, timings).
- ``curves``: a metric's points as a ``Curve``, and their mean ± standard error over seeds (``Aggregate``).
- ``table``: the results table (``results.md``).
- ``records``: each run as a JSON record, imported into a store that lacks it (a study over several stores).
- ``figures``: the learning-curve and adaptation PNGs.
- ``adaptation``: reading the adaptation summaries of ``src/eval.py`` (``eval.protocol=adaptation``).

See docs/evaluation.md#comparing-the-algorithms.
"""
