"""Start-up phases say what they are doing and how long is left: the ETA helper and the gold-path subprocess."""
from __future__ import annotations

import logging
import sys

from src.envs.scienceworld_demos import _run_logged
from src.utils.timing import EtaLog, eta_text


def test_eta_extrapolates_the_rate_so_far():
    assert eta_text(60.0, 1, 3) == "1.0 min elapsed, about 2.0 min left"
    assert eta_text(30.0, 0, 3) == "0.5 min elapsed"


def test_eta_log_reports_counts_and_always_the_last_item(caplog):
    logger = logging.getLogger("test.eta")
    progress = EtaLog(logger, "expert demonstrations", 3, "goals", every_s=3600.0)
    with caplog.at_level(logging.INFO, logger="test.eta"):
        for _ in range(3):
            progress.step(detail="ok")
    # the interval has not passed, so only the final item is logged
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["expert demonstrations: 3/3 goals"]
    assert caplog.records[0].getMessage().endswith("about 0.0 min left, ok")


def test_the_gold_subprocess_output_is_logged_as_it_comes(caplog):
    code = "import sys; print('gold paths: 1/2'); print('gold paths: 2/2', file=sys.stderr); sys.exit(1)"
    with caplog.at_level(logging.INFO, logger="src.envs.scienceworld_demos"):
        returncode, output = _run_logged([sys.executable, "-c", code], timeout_s=60)
    assert returncode == 1
    assert output == "gold paths: 1/2\ngold paths: 2/2\n"
    assert [r.getMessage() for r in caplog.records] == ["[gold] gold paths: 1/2", "[gold] gold paths: 2/2"]
