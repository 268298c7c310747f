"""JSON Lines journals for offline work (spec/events.md "Files for offline work", rules.md §1).

One event per line: ``{"type": "<record name>", <fields as plain JSON>}``; ``null`` for null (not
Avro's ``{"string": ...}`` union form). A line may also carry ``journal_offset`` and
``journal_time_ms``.

Reading (:func:`read_journal`) never raises for bad content: a line that cannot be used is skipped
and counted by reason in ``JournalReader.skipped`` (I/O errors, e.g. a missing file, do raise).

- ``journal_offset`` is the line's own ``journal_offset`` if present (an int >= 0), else the
  0-based index of the line among the non-blank input lines. Blank (whitespace-only) lines are
  ignored entirely; lines that are skipped for bad content still take up an index. The keys
  ``type``, ``journal_offset`` and ``journal_time_ms`` are removed from the record, except that
  RouteDecision, Reservation and ModelCapacity keep ``journal_offset``: it is one of their fields.
- A missing field takes its schema default, in nested records too; a missing field without a
  default skips the line (``missing_field``).
- Unknown keys are dropped (Avro schema-resolution semantics, so a newer producer's extra fields
  do not break an older reader) and counted in ``JournalReader.unknown_fields``.
- JSON numbers are converted as the schema says (an integer in a double field becomes a float), so
  a record read from a file equals the same record decoded from Avro.
- Bytes fields (only in DeadLetter) are strings of code points U+0000..U+00FF, one per byte, as in
  Avro's own JSON encoding.
- Every record is validated against its schema (the same strict check as ``codec.encode``).

Writing (:func:`write_record`) emits ``type`` first, then any extra keys (e.g. ``journal_offset``),
then the fields in schema order (nested records too, map keys sorted); missing fields with a
default are written with it; an invalid record raises ``CodecError``. Non-finite doubles are
written as ``NaN``/``Infinity`` (Python's JSON dialect), which :func:`read_journal` reads back.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from typing import IO, Any, Iterable, Iterator, NamedTuple

from . import codec
from .codec import CodecError

__all__ = [
    "JournalEntry", "JournalReader", "read_journal", "normalize", "to_json_obj", "dumps_record",
    "write_record", "SKIP_REASONS", "RESERVED_KEYS",
]

#: Top-level keys that are line metadata, not record fields.
RESERVED_KEYS = frozenset({"type", "journal_offset", "journal_time_ms"})

#: Every reason a line can be skipped for.
SKIP_REASONS = (
    "bad_encoding",        # not UTF-8 (or not text at all)
    "bad_json",            # not parseable JSON
    "not_object",          # JSON, but not an object
    "missing_type",        # no "type" key
    "unknown_type",        # "type" is not a record name of schemas/ids.json
    "bad_journal_offset",  # journal_offset present but not an integer >= 0
    "bad_journal_time",    # journal_time_ms present but not an integer (or null)
    "missing_field",       # a field without a schema default is missing
    "invalid_value",       # a value does not match the schema
    "oversized",           # the record encodes to more than codec.MAX_MESSAGE_BYTES
)

#: How many (line number, reason, detail) examples a reader keeps in ``errors``.
MAX_ERRORS_KEPT = 100


_FIELDS = {name: frozenset(f["name"] for f in codec.schema(name)["fields"]) for name in codec.RECORD_NAMES}


class JournalEntry(NamedTuple):
    journal_offset: int
    journal_time_ms: int | None
    type: str
    record: dict


class _Skip(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------- reading

def _canon(t: Any, v: Any, path: str, unknown: list | None) -> Any:
    """Fill defaults, drop unknown keys (noted in ``unknown``), convert JSON forms to the
    schema's Python types. Leaves values of the wrong kind alone: validation rejects them."""
    if isinstance(t, str):
        if t in ("double", "float"):
            if _is_int(v):
                try:
                    return float(v)
                except OverflowError:
                    raise _Skip("invalid_value", f"{path}: {v} is out of the double range") from None
        elif t == "bytes":
            if isinstance(v, str):
                try:
                    return v.encode("latin-1")
                except UnicodeEncodeError:
                    raise _Skip("invalid_value",
                                f"{path}: a bytes string may only hold U+0000..U+00FF") from None
        return v
    if isinstance(t, list):  # union
        if v is None:
            return None
        branches = [b for b in t if b != "null"]
        if len(branches) == 1:
            return _canon(branches[0], v, path, unknown)
        for b in branches:  # not used by the current schemas
            try:
                c = _canon(b, v, path, None)
            except _Skip:
                continue
            if codec._compile(b)(c):
                return _canon(b, v, path, unknown)
        return v
    kind = t["type"]
    if kind == "record":
        if not isinstance(v, dict):
            return v
        out = {}
        for f in t["fields"]:
            name = f["name"]
            if name in v:
                out[name] = _canon(f["type"], v[name], f"{path}.{name}", unknown)
            elif "default" in f:
                out[name] = _canon(f["type"], f["default"], f"{path}.{name}", None)
            else:
                raise _Skip("missing_field", f"{path}.{name}")
        if unknown is not None and len(out) != len(v):
            unknown.extend(f"{path}.{k}" for k in v if k not in out)
        return out
    if kind == "array":
        if not isinstance(v, list):
            return v
        return [_canon(t["items"], x, f"{path}[]", unknown) for x in v]
    if kind == "map":
        if not isinstance(v, dict):
            return v
        return {k: _canon(t["values"], x, f"{path}[]", unknown) for k, x in v.items()}
    return _canon(kind, v, path, unknown)


def _normalize(type_name: str, obj: dict, unknown: list | None) -> dict:
    record = _canon(codec.schema(type_name), obj, type_name, unknown)
    try:
        codec.validate(type_name, record)
    except CodecError as e:
        raise _Skip(e.reason, e.detail) from None
    return record


def normalize(type_name: str, obj: dict) -> dict:
    """The record ``obj`` (plain JSON values, without ``type``/``journal_*`` keys) as read from a
    file: defaults filled, unknown keys dropped, values converted and validated. Raises
    ``CodecError`` (reason ``unknown_type``, ``missing_field``, ``invalid_value`` or ``oversized``)."""
    codec.schema(type_name)  # unknown_type
    try:
        return _normalize(type_name, obj, None)
    except _Skip as e:
        raise CodecError(e.reason, e.detail) from None


class JournalReader:
    """Iterate over a JSON Lines journal, yielding :class:`JournalEntry` tuples
    ``(journal_offset, journal_time_ms, type, record)``; iterate it once.

    ``source`` is a path (``str`` or ``os.PathLike``), the whole content as ``bytes``, or an
    iterable of lines (``str`` or ``bytes``, e.g. an open file or a list).

    After (or during) iteration:
      ``skipped``         Counter of skipped lines by reason (see ``SKIP_REASONS``)
      ``unknown_fields``  Counter of dropped unknown keys, as ``"Type.field"`` paths
      ``errors``          the first ``MAX_ERRORS_KEPT`` skips as (line number, reason, detail);
                          line numbers are 1-based and count every physical line
      ``lines``           non-blank lines seen; ``read``: entries yielded
    """

    def __init__(self, source: str | os.PathLike | bytes | Iterable[str | bytes]) -> None:
        self._source = source
        self.skipped: Counter[str] = Counter()
        self.unknown_fields: Counter[str] = Counter()
        self.errors: list[tuple[int, str, str]] = []
        self.lines = 0
        self.read = 0

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def __iter__(self) -> Iterator[JournalEntry]:
        src = self._source
        if isinstance(src, (str, os.PathLike)):
            with open(src, "rb") as fp:
                yield from self._parse(fp)
        elif isinstance(src, (bytes, bytearray)):
            yield from self._parse(bytes(src).splitlines())
        else:
            yield from self._parse(src)

    def _skip(self, lineno: int, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append((lineno, reason, detail[:300]))

    def _parse(self, lines: Iterable[str | bytes]) -> Iterator[JournalEntry]:
        index = 0
        for lineno, raw in enumerate(lines, 1):
            if isinstance(raw, (bytes, bytearray)):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    if not raw.strip():
                        continue
                    index += 1
                    self.lines += 1
                    self._skip(lineno, "bad_encoding", str(e))
                    continue
            elif isinstance(raw, str):
                line = raw
            else:
                index += 1
                self.lines += 1
                self._skip(lineno, "bad_encoding", f"a line is a {type(raw).__name__}, not text")
                continue
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            if not line.strip():
                continue
            offset, index = index, index + 1
            self.lines += 1
            try:
                entry = self._entry(line, offset)
            except _Skip as e:
                self._skip(lineno, e.reason, e.detail)
                continue
            self.read += 1
            yield entry

    def _entry(self, line: str, index: int) -> JournalEntry:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise _Skip("bad_json", str(e)) from None
        if not isinstance(obj, dict):
            raise _Skip("not_object", type(obj).__name__)
        type_name = obj.pop("type", None)
        if type_name is None:
            raise _Skip("missing_type")
        if not isinstance(type_name, str) or type_name not in codec.SCHEMA_IDS:
            raise _Skip("unknown_type", f"{type_name!r:.80}")
        fields = _FIELDS[type_name]
        # RouteDecision, Reservation and ModelCapacity have a journal_offset field of their own:
        # there the key stays in the record and also gives the entry's offset when it is valid.
        if "journal_offset" in fields:
            offset = obj.get("journal_offset")
            if not _is_int(offset) or not 0 <= offset < 2**63:
                offset = index
        else:
            offset = obj.pop("journal_offset", None)
            if offset is None:
                offset = index
            elif not _is_int(offset) or not 0 <= offset < 2**63:
                raise _Skip("bad_journal_offset", f"{offset!r:.80}")
        if "journal_time_ms" in fields:
            time_ms = obj.get("journal_time_ms")
        else:
            time_ms = obj.pop("journal_time_ms", None)
        if time_ms is not None and (not _is_int(time_ms) or not -(2**63) <= time_ms < 2**63):
            if "journal_time_ms" in fields:
                time_ms = None
            else:
                raise _Skip("bad_journal_time", f"{time_ms!r:.80}")
        unknown: list[str] = []
        record = _normalize(type_name, obj, unknown)
        for path in unknown:
            self.unknown_fields[path] += 1
        return JournalEntry(offset, time_ms, type_name, record)


def read_journal(source: str | os.PathLike | bytes | Iterable[str | bytes]) -> JournalReader:
    """``for offset, time_ms, type_name, record in read_journal(path_or_lines): ...``

    Returns the :class:`JournalReader` so its skip counters stay reachable::

        reader = read_journal("journal.jsonl")
        entries = list(reader)
        reader.skipped  # Counter({"unknown_type": 2, ...})
    """
    return JournalReader(source)


# --------------------------------------------------------------------------- writing

def _plain(t: Any, v: Any) -> Any:
    """A validated Avro value as plain JSON values, records in schema field order."""
    if isinstance(t, str):
        if t in ("double", "float"):
            return float(v)
        if t == "bytes":
            return bytes(v).decode("latin-1")
        return v
    if isinstance(t, list):
        if v is None:
            return None
        branches = [b for b in t if b != "null"]
        if len(branches) == 1:
            return _plain(branches[0], v)
        for b in branches:  # not used by the current schemas
            if codec._compile(b)(v):
                return _plain(b, v)
        raise CodecError("invalid_value", "matches no branch of the union")
    kind = t["type"]
    if kind == "record":
        out = {}
        for f in t["fields"]:
            name = f["name"]
            if name in v:
                out[name] = _plain(f["type"], v[name])
            else:  # validated: the field has a default (JSON form, bytes as latin-1 text)
                out[name] = _plain(f["type"], _canon(f["type"], f["default"], name, None))
        return out
    if kind == "array":
        return [_plain(t["items"], x) for x in v]
    if kind == "map":
        return {k: _plain(t["values"], v[k]) for k in sorted(v)}
    return _plain(kind, v)


def to_json_obj(type_name: str, record: dict, **extra: Any) -> dict:
    """``{"type": type_name, **extra, **fields}`` with plain JSON values, fields in schema order.
    Raises ``CodecError`` if ``record`` is not valid for ``type_name``; ``ValueError`` if an
    extra key is ``type`` or a field name."""
    codec.validate(type_name, record)
    sc = codec.schema(type_name)
    clash = [k for k in extra if k == "type" or k in record or any(f["name"] == k for f in sc["fields"])]
    if clash:
        raise ValueError(f"extra keys clash with the record: {clash}")
    out: dict[str, Any] = {"type": type_name}
    out.update(extra)
    out.update(_plain(sc, record))
    return out


def dumps_record(type_name: str, record: dict, **extra: Any) -> str:
    """One JSON Lines line (without the newline) for ``record``; see :func:`to_json_obj`."""
    return json.dumps(to_json_obj(type_name, record, **extra))


def write_record(fp: IO[str], type_name: str, record: dict, **extra: Any) -> None:
    """Write ``record`` as one line ``{"type": ..., **extra, **fields}`` to the text file ``fp``.
    Typical extras: ``journal_offset=...``, ``journal_time_ms=...``."""
    fp.write(dumps_record(type_name, record, **extra) + "\n")
