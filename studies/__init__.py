"""Study tooling outside the product: comparing training runs from their MLflow stores (``comparison``), the
per-episode validation tables and the paired differences recomputed from them (``episode_table``), and merging
adaptation arms run apart (``merge_arms``). It builds on ``src``; nothing in ``src`` imports it
(``tests/test_imports.py``). The command lines are ``scripts/compare_runs.py``, ``scripts/run_study.py``,
``scripts/adaptation_report.py`` and ``scripts/merge_adaptation.py``.
"""
