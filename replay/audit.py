"""Audit: re-run a journal and compare every decision with the recorded one, field by field.

Decisions are matched by (request_id, attempt) and their order within that identity (a queued
request has two). `estimated_ttft_ms` and `cost_ms` compare within 0.01 ms (rules §2); every other
field exactly. A recorded decision repeated byte for byte (a worker re-sending its outbox after a
crash: at-least-once delivery) is counted as a duplicate, not as a difference.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

TOLERANT = {"estimated_ttft_ms": 0.01, "cost_ms": 0.01}


@dataclass
class AuditReport:
    compared: int = 0
    matched: int = 0
    duplicates: int = 0                               # identical re-sent copies of a recorded decision
    differences: list = field(default_factory=list)   # (request_id, attempt, n, field, recorded, replayed)
    missing: list = field(default_factory=list)       # recorded but not reproduced
    extra: list = field(default_factory=list)         # reproduced but not recorded

    @property
    def ok(self) -> bool:
        return not (self.differences or self.missing or self.extra)

    def summary(self) -> str:
        lines = [f"decisions compared: {self.compared}, identical: {self.matched}, "
                 f"with differences: {len({d[:3] for d in self.differences})}, "
                 f"missing from replay: {len(self.missing)}, not recorded: {len(self.extra)}, "
                 f"identical re-sent copies: {self.duplicates}"]
        for rid, attempt, n, name, rec, rep in self.differences[:200]:
            lines.append(f"  {rid}#{attempt} (decision {n + 1}): {name}: recorded {rec!r}, replayed {rep!r}")
        for d in self.missing[:50]:
            lines.append(f"  missing from replay: {d['request_id']}#{d['attempt']} {d['outcome']}")
        for d in self.extra[:50]:
            lines.append(f"  not recorded: {d['request_id']}#{d['attempt']} {d['outcome']}")
        lines.append("AUDIT OK" if self.ok else "AUDIT FAILED")
        return "\n".join(lines)


def by_identity(decisions) -> tuple[dict, int]:
    """Decisions grouped by (request_id, attempt), exact re-sent copies dropped and counted."""
    grouped, duplicates = defaultdict(list), 0
    for d in decisions:
        same = grouped[(d["request_id"], d["attempt"])]
        if d in same:
            duplicates += 1
        else:
            same.append(d)
    return grouped, duplicates


def compare(recorded: list[dict], replayed: list[dict], fields: list[str] | None = None) -> AuditReport:
    report = AuditReport()
    (rec_by, report.duplicates), (rep_by, _) = by_identity(recorded), by_identity(replayed)
    for ident, recs in rec_by.items():
        reps = rep_by.get(ident, [])
        for n, rec in enumerate(recs):
            if n >= len(reps):
                report.missing.append(rec)
                continue
            rep = reps[n]
            report.compared += 1
            diffs = []
            for name in fields or rec.keys():
                a, b = rec.get(name), rep.get(name)
                tol = TOLERANT.get(name)
                if tol is not None and isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    same = abs(a - b) <= tol
                else:
                    same = a == b
                if not same:
                    diffs.append((ident[0], ident[1], n, name, a, b))
            if diffs:
                report.differences.extend(diffs)
            else:
                report.matched += 1
        report.extra.extend(reps[len(recs):])
    for ident, reps in rep_by.items():
        if ident not in rec_by:
            report.extra.extend(reps)
    return report
