"""A Faust worker (`faust -A app worker`) in a child process, for integration tests.

The implementation lives in `streams.worker_process` (the demo uses it too); re-exported here."""
from __future__ import annotations

from streams.worker_process import ROOT, Worker, free_port

__all__ = ["ROOT", "Worker", "free_port"]
