"""A short live run through the real broker and a real worker: every request gets its decision,
queued ones their follow-up, routed ones a Completion; nothing is lost."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def test_short_live_run_loses_no_request(kafka_bootstrap, tmp_path):
    report = tmp_path / "live.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EIGENINFERENCE_")}
    env.update(KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "streams.sim", "live", "--preset", "default", "--duration", "12", "--rate", "8",
         "--providers", "10", "--seed", "3", "--report", str(report), "--workdir", str(tmp_path / "var"),
         "--drain", "30"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "decisions/s" in proc.stdout
    figures = json.loads(report.with_suffix(".json").read_text())
    assert figures["preset"] == "default"
    assert figures["sent"] > 50
    assert figures["lost"] == 0 and figures["decided"] == figures["sent"]
    assert figures["followups_missing"] == 0 and figures["abandoned"] == 0 and not figures["errors"]
    routed = figures["routed"]
    assert routed > 0 and sum(figures["completions"].values()) == routed   # every routed request completed
    text = report.read_text()
    assert "## Fleet" in text and "switchyard_decisions_total" in text
