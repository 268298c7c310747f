"""Which topics a RouteRequest may name as its `reply_to` (events.md: "topic; empty = default").

The worker writes each decision to the topic its request names, so the name is checked at ingest
(a refused request is dead-lettered, reason `bad_reply_to`) and by `GatewayClient` before it sends:
- a legal Kafka topic name (a send to an illegal one would fail at every retry of the entry);
- under the deployment's topics, `<prefix>switchyard.`: the worker also writes its changelog and
  group topics (`<app id>-...`), and a decision there would corrupt what a worker restores;
- not one of the worker's own topics (its inputs, the journal, the lease, reservations, capacity,
  dead letters): a decision appended to the journal would look like another worker's entry.
The default reply topic, `<prefix>switchyard.decisions`, and private ones such as
`<prefix>switchyard.replies.<uuid>` pass.
"""
from __future__ import annotations

import re

DEPLOYMENT = "switchyard."
WORKER_OWNED = frozenset(DEPLOYMENT + name for name in (
    "providers", "requests", "completions", "config", "journal", "lease", "reservations", "capacity",
    "deadletter"))
LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def reply_to_problem(reply_to: str, prefix: str = "") -> str | None:
    """Why a non-empty `reply_to` may not receive decisions, or None if it may."""
    if not LEGAL_TOPIC.fullmatch(reply_to) or reply_to in (".", ".."):
        return f"{reply_to[:300]!r} is not a legal topic name ([A-Za-z0-9._-], at most 249)"
    if not reply_to.startswith(prefix + DEPLOYMENT):
        return f"{reply_to!r} is not under {prefix + DEPLOYMENT!r}"
    if reply_to[len(prefix):] in WORKER_OWNED:
        return f"{reply_to!r} is one of the worker's own topics"
    return None
