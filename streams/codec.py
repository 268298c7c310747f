"""Avro codec for Switchyard events (wire contract: spec/events.md).

Every Kafka value is framed in the Confluent wire format::

    byte 0      magic byte, always 0
    bytes 1..4  schema id, big-endian unsigned (fixed map in ``schemas/ids.json``)
    bytes 5..   Avro binary body (``fastavro.schemaless_writer``)

The schema id names the record type, so one topic can carry several record types
(``switchyard.providers``, ``switchyard.journal``).

Pure module: no Kafka or Faust import. The schemas are loaded and parsed once, at import.

Every way ``decode`` can fail raises :class:`CodecError` (a ``ValueError``) with a short,
machine-readable ``reason`` (one of :data:`REASONS`), suitable as a dead-letter reason.
"""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

from fastavro import parse_schema, schemaless_reader, schemaless_writer

__all__ = [
    "CodecError", "REASONS", "MAGIC", "HEADER_SIZE", "MAX_MESSAGE_BYTES", "SCHEMA_DIR",
    "SCHEMA_IDS", "RECORD_NAMES", "PROVIDER_TYPES", "INPUT_TYPES", "JOURNAL_TYPES",
    "OUTPUT_TYPES", "TOPIC_TYPES", "schema", "schema_id", "encode", "decode", "decode_as",
    "validate", "peek_type",
]

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
MAGIC = 0
HEADER_SIZE = 5
#: Largest framed message accepted by ``decode`` and produced by ``encode`` (Kafka's default
#: ``message.max.bytes`` is about 1 MB). Bounds the memory a hostile message can cost.
MAX_MESSAGE_BYTES = 1 << 20

#: Every ``CodecError.reason``.
REASONS = frozenset({
    "empty",             # None or b"" (e.g. a tombstone)
    "not_bytes",         # decode given something that is not bytes-like
    "oversized",         # longer than MAX_MESSAGE_BYTES
    "bad_magic",         # first byte is not 0
    "truncated",         # shorter than the header, or the body ends before the data it
                         # claims (this includes a string/array/map length beyond the end)
    "unknown_schema_id", # schema id not in schemas/ids.json
    "malformed_avro",    # body is not valid Avro for the schema (bad UTF-8, bad varint, ...)
    "trailing_bytes",    # body decoded but bytes are left over
    "unexpected_type",   # decode_as: a valid record of a type the caller did not expect
    "unknown_type",      # encode/validate/schema: no record of that name
    "invalid_value",     # encode/validate: value does not match the schema
})


class CodecError(ValueError):
    """Any encode/decode failure. ``reason`` is one of :data:`REASONS`; ``detail`` is free text."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- schemas

def _load() -> tuple[dict[str, int], dict[str, dict]]:
    ids = json.loads((SCHEMA_DIR / "ids.json").read_text(encoding="utf-8"))
    parsed: dict[str, dict] = {}
    for name, sid in ids.items():
        if not isinstance(sid, int) or isinstance(sid, bool) or not 0 <= sid < 2**32:
            raise RuntimeError(f"schemas/ids.json: bad id for {name}: {sid!r}")
        raw = json.loads((SCHEMA_DIR / f"{name}.avsc").read_text(encoding="utf-8"))
        # Each .avsc is self-contained (nested records are defined inline): a fresh
        # named-type registry per file keeps them independent.
        sc = parse_schema(raw, named_schemas={})
        if sc.get("name") != f"switchyard.{name}":
            raise RuntimeError(f"{name}.avsc defines {sc.get('name')!r}")
        parsed[name] = sc
    if len(set(ids.values())) != len(ids):
        raise RuntimeError("schemas/ids.json: duplicate schema ids")
    return ids, parsed


_IDS, _SCHEMAS = _load()
#: Record name -> schema id (read-only view of ``schemas/ids.json``).
SCHEMA_IDS: Mapping[str, int] = dict(_IDS)
RECORD_NAMES: tuple[str, ...] = tuple(_IDS)
_BY_ID: dict[int, tuple[str, dict]] = {sid: (name, _SCHEMAS[name]) for name, sid in _IDS.items()}
_HEADERS: dict[str, bytes] = {name: struct.pack(">BI", MAGIC, sid) for name, sid in _IDS.items()}


def _union_records(sc: dict) -> list[tuple[str, str]]:
    """Top-level fields typed ["null", <one record>]: (field name, record full name)."""
    out = []
    for f in sc["fields"]:
        t = f["type"]
        if isinstance(t, list):
            recs = [b for b in t if isinstance(b, dict) and b.get("type") == "record"]
            others = [b for b in t if b not in recs]
            if len(recs) == 1 and others == ["null"]:
                out.append((f["name"], recs[0]["name"]))
    return out


_UNION_RECORDS: dict[str, list] = {n: w for n, sc in _SCHEMAS.items() if (w := _union_records(sc))}

PROVIDER_TYPES = frozenset({"ProviderRegistered", "Heartbeat", "ProviderDisconnected"})
#: Events the router consumes (what ingest appends to the journal), Tick excluded.
INPUT_TYPES = PROVIDER_TYPES | {"RouteRequest", "Completion", "ConfigChange"}
JOURNAL_TYPES = INPUT_TYPES | {"Tick"}
OUTPUT_TYPES = frozenset({"RouteDecision", "Reservation", "ModelCapacity", "DeadLetter"})
#: Topic -> record types its values may have (events.md, "Topics").
TOPIC_TYPES: Mapping[str, frozenset] = {
    "switchyard.providers": PROVIDER_TYPES,
    "switchyard.requests": frozenset({"RouteRequest"}),
    "switchyard.completions": frozenset({"Completion"}),
    "switchyard.config": frozenset({"ConfigChange"}),
    "switchyard.journal": JOURNAL_TYPES,
    "switchyard.decisions": frozenset({"RouteDecision"}),
    "switchyard.reservations": frozenset({"Reservation"}),
    "switchyard.capacity": frozenset({"ModelCapacity"}),
    "switchyard.deadletter": frozenset({"DeadLetter"}),
}


def schema(name: str) -> dict:
    """The parsed (fastavro) schema of record ``name``. Do not mutate it."""
    try:
        return _SCHEMAS[name]
    except (KeyError, TypeError):
        raise CodecError("unknown_type", repr(name)) from None


def schema_id(name: str) -> int:
    try:
        return _IDS[name]
    except (KeyError, TypeError):
        raise CodecError("unknown_type", repr(name)) from None


# --------------------------------------------------------------------------- encode

def validate(name: str, value: Any) -> None:
    """Raise ``CodecError("invalid_value")`` unless ``value`` encodes as record ``name``.

    Stricter than plain Avro writing: longs must be ints in range (not bools or floats),
    doubles ints or floats (not bools), records and maps dicts (records without unknown keys),
    arrays lists, strings encodable as UTF-8; a missing field is fine when the schema gives it
    a default.
    """
    encode(name, value)


def encode(name: str, value: Mapping[str, Any]) -> bytes:
    """Frame ``value`` as record ``name``: magic byte, schema id, Avro body.

    Raises ``CodecError`` with reason ``unknown_type``, ``invalid_value`` or ``oversized``.
    """
    try:
        header = _HEADERS[name]
    except (KeyError, TypeError):
        raise CodecError("unknown_type", repr(name)) from None
    # fastavro's writer silently truncates a float written to a long field and takes a bool as
    # a number: the strict pre-check closes that gap.
    try:
        ok = _CHECKS[name](value)
    except Exception:  # noqa: BLE001 - e.g. a comparison on an exotic object
        ok = False
    if not ok:
        why = _why(_SCHEMAS[name], value, name) or f"{name}: does not match the schema"
        raise CodecError("invalid_value", why)
    wraps = _UNION_RECORDS.get(name)
    if wraps:
        # Name the branch of a ["null", Record] union (fastavro's tuple notation): otherwise
        # the writer validates the record again to find the branch, which doubles its cost.
        copied = False
        for field, rname in wraps:
            x = value.get(field)
            if x is not None:
                if not copied:  # copy once; never mutate the caller's dict
                    value, copied = dict(value), True
                value[field] = (rname, x)
    buf = io.BytesIO()
    buf.write(header)
    try:
        schemaless_writer(buf, _SCHEMAS[name], value, strict_allow_default=True)
    except Exception as e:  # noqa: BLE001 - e.g. UnicodeEncodeError (lone surrogate), OverflowError
        raise CodecError("invalid_value", f"{name}: {type(e).__name__}: {e}") from None
    if buf.tell() > MAX_MESSAGE_BYTES:
        raise CodecError("oversized", f"{buf.tell()} bytes > {MAX_MESSAGE_BYTES}")
    return buf.getvalue()


# Strict type checks, compiled once per schema into closures (about twice as fast as
# fastavro.validation.validate, and stricter: unknown record keys fail).
_MISSING = object()
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


def _is_long(v: Any) -> bool:
    return ((type(v) is int or (isinstance(v, int) and not isinstance(v, bool)))
            and _LONG_MIN <= v <= _LONG_MAX)


def _is_int(v: Any) -> bool:
    return _is_long(v) and _INT_MIN <= v <= _INT_MAX


def _is_double(v: Any) -> bool:
    # An int is accepted (and written as a float) within the long range, as fastavro does.
    return type(v) is float or (isinstance(v, float) or _is_long(v))


_PRIMITIVE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "long": _is_long,
    "int": _is_int,
    "double": _is_double,
    "float": _is_double,
    "boolean": lambda v: v is True or v is False,
    "bytes": lambda v: isinstance(v, (bytes, bytearray)),
    "null": lambda v: v is None,
}


def _compile(t: Any):
    if isinstance(t, str):
        return _PRIMITIVE_CHECKS[t]  # KeyError: a type this codec does not support
    if isinstance(t, list):
        nullable = "null" in t
        branches = [_compile(b) for b in t if b != "null"]
        if len(branches) == 1:
            b0 = branches[0]
            return (lambda v: v is None or b0(v)) if nullable else b0
        return lambda v: (nullable and v is None) or any(b(v) for b in branches)
    kind = t["type"]
    if kind == "array":
        item = _compile(t["items"])
        return lambda v: isinstance(v, list) and all(map(item, v))
    if kind == "map":
        val = _compile(t["values"])
        return lambda v: (isinstance(v, dict) and all(type(k) is str or isinstance(k, str) for k in v)
                          and all(map(val, v.values())))
    if kind == "record":
        fields = [(f["name"], _compile(f["type"]), "default" in f) for f in t["fields"]]
        names = frozenset(f[0] for f in fields)

        def check(v: Any) -> bool:
            if not isinstance(v, dict):
                return False
            get = v.get
            seen = 0
            for fname, pred, has_default in fields:
                x = get(fname, _MISSING)
                if x is _MISSING:
                    if not has_default:
                        return False
                elif pred(x):
                    seen += 1
                else:
                    return False
            return seen == len(v) or all(k in names for k in v)
        return check
    return _compile(kind)  # {"type": "long"} and friends


def _why(t: Any, v: Any, path: str) -> str:
    """Explain why ``v`` fails ``t`` (slow path, only after a failed check)."""
    if isinstance(t, str):
        return "" if _PRIMITIVE_CHECKS[t](v) else f"{path}: {type(v).__name__} {v!r:.60} is not a valid {t}"
    if isinstance(t, list):
        if v is None and "null" in t:
            return ""
        reasons = [_why(b, v, path) for b in t if b != "null"]
        if any(r == "" for r in reasons):
            return ""
        return reasons[0] if len(reasons) == 1 else f"{path}: matches no branch of the union"
    kind = t["type"]
    if kind == "record":
        if not isinstance(v, dict):
            return f"{path}: {type(v).__name__} is not a record (dict)"
        names = {f["name"] for f in t["fields"]}
        extra = sorted(map(str, set(v) - names))
        if extra:
            return f"{path}: unknown field(s) {', '.join(extra)}"
        for f in t["fields"]:
            if f["name"] not in v:
                if "default" not in f:
                    return f"{path}.{f['name']}: missing (no default)"
                continue
            r = _why(f["type"], v[f["name"]], f"{path}.{f['name']}")
            if r:
                return r
        return ""
    if kind == "array":
        if not isinstance(v, list):
            return f"{path}: {type(v).__name__} is not an array (list)"
        for i, x in enumerate(v):
            r = _why(t["items"], x, f"{path}[{i}]")
            if r:
                return r
        return ""
    if kind == "map":
        if not isinstance(v, dict):
            return f"{path}: {type(v).__name__} is not a map (dict)"
        for k, x in v.items():
            if not isinstance(k, str):
                return f"{path}: map key {k!r:.60} is not a string"
            r = _why(t["values"], x, f"{path}[{k!r:.60}]")
            if r:
                return r
        return ""
    return _why(kind, v, path)


_CHECKS = {name: _compile(sc) for name, sc in _SCHEMAS.items()}


# --------------------------------------------------------------------------- decode

def _header(data: Any) -> tuple[str, dict]:
    if data is None:
        raise CodecError("empty", "no value")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("not_bytes", type(data).__name__)
    n = len(data)
    if n == 0:
        raise CodecError("empty", "zero-length value")
    if n > MAX_MESSAGE_BYTES:
        raise CodecError("oversized", f"{n} bytes > {MAX_MESSAGE_BYTES}")
    if data[0] != MAGIC:
        raise CodecError("bad_magic", f"first byte {data[0]}")
    if n < HEADER_SIZE:
        raise CodecError("truncated", f"{n}-byte value is shorter than the 5-byte header")
    sid = int.from_bytes(data[1:5], "big")
    try:
        return _BY_ID[sid]
    except KeyError:
        raise CodecError("unknown_schema_id", str(sid)) from None


def peek_type(data: bytes) -> str:
    """The record name the frame claims, from the header alone (body not checked)."""
    return _header(data)[0]


def _body(name: str, sc: dict, data: Any) -> dict:
    if isinstance(data, memoryview):
        data = data.tobytes()
    fo = io.BytesIO(data)  # shares the bytes object's buffer: no copy
    fo.seek(HEADER_SIZE)
    try:
        value = schemaless_reader(fo, sc, None)
    except EOFError as e:
        # Also what fastavro raises when a string/bytes/array/map length points past the end;
        # it checks lengths against the data before allocating, so 2**40 costs nothing.
        raise CodecError("truncated", f"{name}: {e}" if str(e) else name) from None
    except IndexError as e:  # the C reader running off the end inside a varint
        raise CodecError("truncated", f"{name}: {e}") from None
    except Exception as e:  # noqa: BLE001 - UnicodeDecodeError, OverflowError, MemoryError, ...
        raise CodecError("malformed_avro", f"{name}: {type(e).__name__}: {e}") from None
    end = fo.tell()
    if end != len(data):
        raise CodecError("trailing_bytes", f"{name}: {len(data) - end} bytes after the record")
    if not isinstance(value, dict):  # cannot happen for record schemas; belt and braces
        raise CodecError("malformed_avro", f"{name}: decoded a {type(value).__name__}")
    return value


def decode(data: bytes) -> tuple[str, dict]:
    """Decode one framed message into ``(record_name, record_dict)``.

    Nullable fields come back as plain values or ``None``; nested records as dicts.
    Raises :class:`CodecError` and nothing else.
    """
    name, sc = _header(data)
    return name, _body(name, sc, data)


def decode_as(data: bytes, expected_names: Iterable[str] | str) -> tuple[str, dict]:
    """Like :func:`decode`, but the record must be one of ``expected_names``
    (a name, or a collection such as ``TOPIC_TYPES[topic]``); else ``CodecError("unexpected_type")``.
    The type is checked from the header, before the body is decoded."""
    name, sc = _header(data)
    if isinstance(expected_names, str):
        ok = name == expected_names
    else:
        ok = name in expected_names
    if not ok:
        raise CodecError("unexpected_type", name)
    return name, _body(name, sc, data)


def _benchmark(seconds: float = 1.0) -> dict[str, float]:
    """Encodes and decodes per second of a Heartbeat with 2 slots (``python -m streams.codec``)."""
    import time

    slot = {"model": "gemma-4-26b-qat-4bit", "state": "running", "num_running": 2,
            "num_waiting": 1, "max_concurrency": 4, "active_tokens": 712,
            "max_tokens_potential": 4096, "observed_decode_tps": 22.5,
            "observed_prefill_tps": 310.25, "active_token_budget_used": 712,
            "active_token_budget_max": 100000, "queued_token_budget": 356,
            "kv_bytes_per_token": 196608, "model_load_time_ms": 8400.0}
    hb = {"event_id": "hb-box-a-7", "provider_id": "box-a", "seq": 7,
          "sent_at_ms": 1_700_000_002_000, "status": "serving",
          "warm_models": ["gemma-4-26b-qat-4bit", "gpt-oss-20b"],
          "system_metrics": {"memory_pressure": 0.42, "cpu_usage": 0.3, "thermal_state": "fair"},
          "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 31.5,
                               "free_for_load_gb": 20.25,
                               "slots": [slot, dict(slot, model="gpt-oss-20b", state="idle")]}}
    data = encode("Heartbeat", hb)
    assert decode(data) == ("Heartbeat", hb)
    out = {"bytes": float(len(data))}
    for label, fn, arg in (("encode_per_s", encode, ("Heartbeat", hb)), ("decode_per_s", decode, (data,))):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            for _ in range(1000):
                fn(*arg)
            n += 1000
        out[label] = n / elapsed
    return out


if __name__ == "__main__":
    r = _benchmark()
    print(f"Heartbeat with 2 slots ({r['bytes']:.0f} bytes framed): "
          f"{r['encode_per_s']:,.0f} encodes/s, {r['decode_per_s']:,.0f} decodes/s (one core)")
