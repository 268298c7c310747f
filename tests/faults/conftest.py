"""The fault tests take minutes (docs/reliability.md): they run when asked for with `-m slow`
(`pytest -m slow tests/faults`) or with SWITCHYARD_SLOW=1, and are skipped otherwise, so a plain
`pytest` / `make test` stays as fast as before."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.option.markexpr or "") or os.environ.get("SWITCHYARD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow fault test: run with `pytest -m slow tests/faults` (docs/reliability.md)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents and item.get_closest_marker("slow"):
            item.add_marker(skip)
