"""A replay's reading and writing, done in child processes while this one runs the routing core.

The core is sequential, but decoding the journal and encoding the decisions are not part of it:
fastavro takes about a fifth of what applying an entry takes, JSON Lines (parse, normalise,
validate) more, and writing a decision as validated JSON a tenth. So forked children do them, and
hand over batches of plain tuples and dicts in `marshal`'s format, which loads about ten times
faster than fastavro decodes. Entries, decisions, their order and their values are exactly what
the in-process code reads and writes; only the work moves to the other core.

Where `fork` is not available, both run in-process.
"""
from __future__ import annotations

import marshal
import multiprocessing
import pickle
import sys
from collections import Counter
from typing import Callable, Iterable, Iterator

from streams.jsonl import JournalEntry, write_record

BATCH = 1000  # entries per hand-over: ≈ 300 KB, a few tens of ms of the child's work
CAN_FORK = "fork" in multiprocessing.get_all_start_methods()
FORK = multiprocessing.get_context("fork") if CAN_FORK else None


def _start(target, args: tuple, name: str):
    """Fork a child running target(*args). The standard streams are flushed first: a forked child
    flushes its copy of their buffers when it exits, which would write pending output twice."""
    sys.stdout.flush()
    sys.stderr.flush()
    child = FORK.Process(target=target, args=args, daemon=True, name=name)
    child.start()
    return child


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
        receiving, sending = FORK.Pipe(duplex=False)
        child = _start(_produce, (self.open_entries, sending), "journal-reader")
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


class WriteInChild:
    """Write records as `streams.jsonl.write_record` does, to `path` (or stdout when None), from a
    forked child process; use as a context manager. An error of the writer (a record its schema
    refuses) is raised here when the writer is closed, with its type."""

    def __init__(self, path: str | None):
        self.path = path
        self.batch: list = []
        self.conn = self.child = self.fp = None

    def __enter__(self) -> "WriteInChild":
        if not CAN_FORK:
            self.fp = open(self.path, "w") if self.path else sys.stdout
            return self
        self.conn, theirs = FORK.Pipe()
        self.child = _start(_consume, (self.path, theirs), "decision-writer")
        theirs.close()
        return self

    def write(self, type_name: str, record: dict) -> None:
        if self.fp is not None:
            write_record(self.fp, type_name, record)
            return
        self.batch.append((type_name, record))
        if len(self.batch) == BATCH:
            self._send("records", self.batch)
            self.batch = []

    def _send(self, kind: str, payload) -> None:
        try:
            self.conn.send_bytes(marshal.dumps((kind, payload)))
        except OSError:  # the child stopped
            self._answer()

    def _answer(self) -> None:
        """Wait for the child's answer: "done", or its error, raised here."""
        try:
            kind, payload = marshal.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.child.join(5)
            raise RuntimeError(f"the decision writer process ended early (exit code {self.child.exitcode})") \
                from None
        if kind == "error":
            raise pickle.loads(payload)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fp is not None:
            if self.fp is not sys.stdout:
                self.fp.close()
            return
        try:
            if exc_type is None:
                self._send("records", self.batch)
                self._send("end", None)
                self._answer()  # "done": everything is written
        finally:
            self.conn.close()
            if exc_type is not None and self.child.is_alive():
                self.child.terminate()
            self.child.join()


def _consume(path: str | None, conn) -> None:
    """The child: write every record received, then acknowledge the end mark (or report the error)."""
    try:
        fp = open(path, "w") if path else sys.stdout
        try:
            while True:
                kind, payload = marshal.loads(conn.recv_bytes())
                if kind == "end":
                    break
                for type_name, record in payload:
                    write_record(fp, type_name, record)
        finally:
            fp.flush()
            if fp is not sys.stdout:
                fp.close()
        conn.send_bytes(marshal.dumps(("done", None)))
    except EOFError:  # the parent went away
        pass
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        try:
            conn.send_bytes(marshal.dumps(("error", pickle.dumps(exc))))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()
