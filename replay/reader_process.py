"""Read and decode a journal in a second process while this one replays it.

The routing core is sequential, but decoding is not part of it: fastavro takes about a fifth of
what applying an entry takes, and JSON Lines (parse, normalise, validate) more. So a forked child
reads and decodes the journal, and hands over batches of plain tuples in `marshal`'s format, which
this process loads about ten times faster than fastavro decodes. The entries, their order and
their values are those the source yields in-process; only the work moves to the other core.

Where `fork` is not available, the source is read in-process.
"""
from __future__ import annotations

import marshal
import multiprocessing
import pickle
from collections import Counter
from typing import Callable, Iterable, Iterator

from streams.jsonl import JournalEntry

BATCH = 1000  # entries per hand-over: ≈ 300 KB, a few tens of ms of the child's work
CAN_FORK = "fork" in multiprocessing.get_all_start_methods()


class ReadInChild:
    """Iterate (once) the entries `open_entries()` yields, read in a forked child process. After the
    iteration, `skipped` holds the source's own `skipped` counter (a JSON Lines reader's skipped
    lines by reason), if it has one. An error of the source is raised here, with its type."""

    def __init__(self, open_entries: Callable[[], Iterable[JournalEntry]]):
        self.open_entries = open_entries
        self.skipped: Counter = Counter()

    def __iter__(self) -> Iterator[JournalEntry]:
        if not CAN_FORK:
            entries = self.open_entries()
            yield from entries
            self.skipped.update(getattr(entries, "skipped", {}))
            return
        ctx = multiprocessing.get_context("fork")
        receiving, sending = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_produce, args=(self.open_entries, sending), daemon=True,
                            name="journal-reader")
        child.start()
        sending.close()  # the child's end: EOF here when the child is gone
        make = JournalEntry._make
        try:
            while True:
                try:
                    kind, payload = marshal.loads(receiving.recv_bytes())
                except EOFError:
                    child.join(5)
                    raise RuntimeError(f"the journal reader process ended early (exit code {child.exitcode})") \
                        from None
                if kind == "entries":
                    yield from map(make, payload)
                elif kind == "end":
                    self.skipped.update(payload)
                    return
                else:  # "error"
                    raise pickle.loads(payload)
        finally:  # also when the consumer stops early (explain finds its request)
            receiving.close()
            if child.is_alive():
                child.terminate()
            child.join()


def _produce(open_entries: Callable[[], Iterable[JournalEntry]], conn) -> None:
    """The child: read the source, send batches, then the end mark (or the error)."""
    try:
        entries = open_entries()
        batch = []
        for entry in entries:
            batch.append(tuple(entry))
            if len(batch) == BATCH:
                conn.send_bytes(marshal.dumps(("entries", batch)))
                batch = []
        if batch:
            conn.send_bytes(marshal.dumps(("entries", batch)))
        conn.send_bytes(marshal.dumps(("end", dict(getattr(entries, "skipped", {})))))
    except BrokenPipeError:  # the parent stopped reading
        pass
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        try:
            conn.send_bytes(marshal.dumps(("error", pickle.dumps(exc))))
        except Exception:  # noqa: BLE001 - unpicklable or the pipe is gone: the parent sees EOF
            pass
    finally:
        conn.close()
