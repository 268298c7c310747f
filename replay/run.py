"""Re-run a journal from a fresh state with the same routing core as production (replay `run`)."""
from __future__ import annotations

from typing import Iterable, Iterator

from streams.config import DEFAULT, Config
from streams.jsonl import JournalEntry
from streams.router import Router


def replay(entries: Iterable[JournalEntry], config: Config = DEFAULT,
           router: Router | None = None) -> Iterator[tuple[JournalEntry, list]]:
    """Apply each entry to a fresh Router (rules §3: starting from the defaults, never from the
    environment); yield every entry with the outputs it caused."""
    router = router or Router(config)
    for entry in entries:
        yield entry, router.apply(entry.journal_offset, entry.journal_time_ms, entry.type, entry.record)


def decisions(entries: Iterable[JournalEntry], config: Config = DEFAULT) -> Iterator[dict]:
    for _, outputs in replay(entries, config):
        for kind, record in outputs:
            if kind == "RouteDecision":
                yield record
