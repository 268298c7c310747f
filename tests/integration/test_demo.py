"""`python -m streams.demo` end to end against the session's broker: it exits 0 and its report shows
routed traffic and no lost request (every request got a decision)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from streams.worker_process import ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(400)]


def test_demo_runs_and_reports(kafka_bootstrap, tmp_path):
    report = tmp_path / "out" / "demo-report.md"
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "streams.demo", "--duration", "20", "--rate", "10", "--providers", "8",
         "--report", str(report), "--workdir", str(tmp_path / "var")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report.exists() and f"report: {report}" in proc.stdout
    assert "decisions/s" in proc.stdout  # the live summary ran (one line per 2 s without a TTY)

    figures = json.loads(report.with_suffix(".json").read_text())
    assert figures["sent"] > 100  # ~200 Poisson arrivals expected
    assert figures["routed"] > 0
    assert figures["lost"] == 0 and figures["decided"] == figures["sent"]
    assert figures["followups_missing"] == 0 and figures["abandoned"] == 0 and not figures["errors"]
    assert figures["latency_ms"]["50"] > 0

    text = report.read_text()
    assert "lost requests (no decision within 10 s): 0**" in text
    assert "| routed |" in text and "## Fleet" in text and "switchyard_decisions_total" in text
    assert "scaled ×20" in text
