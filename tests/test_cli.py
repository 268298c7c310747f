"""`python -m streams.cli` refuses bad arguments and request fields with exit 2 and one line, and
says so in one line when there is no broker (exit 1): no tracebacks for an operator."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_BROKER = "127.0.0.1:1"  # nothing listens there


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streams.cli", "--bootstrap", NO_BROKER, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["route", "--model", "m", "--prompt-tokens", "99999999999999999999"], "refused: "),
    (["route", "--model", "m", "--prompt-tokens", "10", "--reply-topic", "bad topic!!"], "refused: reply_topic"),
    (["route", "--model", "m", "--prompt-tokens", "10", "--reply-topic", "switchyard.journal"],
     "one of the worker's own topics"),
    (["route", "--model", "m", "--prompt-tokens", "10", "--timeout", "0"], "must be above 0"),
    (["tail", "decisions", "--limit", "-1"], "must be above 0"),
    (["config", "set", "NO_SUCH_SETTING=1"], "refused: "),
])
def test_bad_arguments_are_refused_with_exit_2_before_anything_is_sent(args, says):
    res = cli(*args)
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_no_broker_is_one_line_and_exit_1():
    res = cli("route", "--model", "m", "--prompt-tokens", "10", "--timeout", "2")
    assert res.returncode == 1 and "error: " in res.stderr and NO_BROKER in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
