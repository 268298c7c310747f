"""Tests for streams/codec.py and the schemas in schemas/ (wire contract: spec/events.md)."""
from __future__ import annotations

import copy
import io
import json
import math
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import fastavro
import pytest
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form
from fastavro.validation import validate as fastavro_validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams import codec
from streams.codec import CodecError, decode, decode_as, encode

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"

# --------------------------------------------------------------------------- frozen contract
# Copied from spec/events.md. Fields may be added (with defaults), never removed, renamed,
# re-typed or reordered: every check below fails if that happens.
S, L, D, B = "string", "long", "double", "boolean"


def opt(t):
    return ["null", t]


def arr(t):
    return ["array", t]


def rec(**fields):
    return {"fields": fields}


SLOT = rec(model=S, state=S, num_running=L, num_waiting=L, max_concurrency=L, active_tokens=L,
           max_tokens_potential=L, observed_decode_tps=D, observed_prefill_tps=D,
           active_token_budget_used=L, active_token_budget_max=L, queued_token_budget=L,
           kv_bytes_per_token=L, model_load_time_ms=D)

FROZEN = {
    "ProviderRegistered": rec(
        event_id=S, provider_id=S, registered_at_ms=L, version=S, account_id=opt(S), trust_level=S,
        private_only=B,
        hardware=rec(chip_name=S, chip_family=S, chip_tier=S, memory_gb=D, memory_bandwidth_gbs=D,
                     gpu_cores=L),
        decode_tps=D, prefill_tps=D, models=arr(rec(id=S, size_bytes=L, min_ram_gb=D, is_vision=B))),
    "Heartbeat": rec(
        event_id=S, provider_id=S, seq=L, sent_at_ms=L, status=S, warm_models=arr(S),
        system_metrics=rec(memory_pressure=D, cpu_usage=D, thermal_state=S),
        backend_capacity=opt(rec(total_memory_gb=D, gpu_memory_active_gb=D, free_for_load_gb=opt(D),
                                 slots=arr(SLOT)))),
    "ProviderDisconnected": rec(event_id=S, provider_id=S, at_ms=L, reason=S),
    "RouteRequest": rec(
        request_id=S, attempt=L, model=S, prompt_tokens=L, max_tokens=L, max_ttft_ms=D,
        min_decode_tps=D, account_id=opt(S), consumer_key=opt(S), cache_affinity_key=opt(S),
        self_route_only=B, prefer_owner=B, requires_vision=B, allowed_provider_ids=arr(S),
        excluded_provider_ids=arr(S), avoid_version=opt(S), reply_to=S, sent_at_ms=L),
    "RouteDecision": rec(
        request_id=S, attempt=L, outcome=S, provider_id=opt(S), model=S, reason=opt(S),
        http_status=L, retry_after_s=opt(L), estimated_ttft_ms=D, prefill_source=S, cost_ms=D,
        selected_by=S, band_members=L, candidates=L, capacity_rejections=L, too_large=L,
        ttft_rejections=L, journal_offset=L, config_id=S, decided_at_ms=L),
    "Reservation": rec(request_id=S, attempt=L, provider_id=S, model=S, tokens=L, kv_bytes=L,
                       reserved_at_ms=L, journal_offset=L),
    "Completion": rec(event_id=S, request_id=S, attempt=L, provider_id=S, model=S, status=S,
                      prompt_tokens=L, completion_tokens=L, ttft_ms=D, completed_at_ms=L),
    "ConfigChange": rec(config_id=S, settings=["map", S], changed_at_ms=L, author=S),
    "Tick": rec(at_ms=L),
    "ModelCapacity": rec(model=S, routable_providers=L, remaining_concurrency=L, remaining_tokens=L,
                         estimated_ttft_ms=D, at_ms=L, journal_offset=L),
    "DeadLetter": rec(original_key=opt("bytes"), original_value="bytes", topic=S, partition=L,
                      offset=L, reason=S, detail=S, at_ms=L),
}

# Fields that deliberately have no default (an event is meaningless without them): a JSON Lines
# line lacking one is skipped. Every other field has a default.
NO_DEFAULT = {
    "ProviderRegistered": {"event_id", "provider_id"},
    "Heartbeat": {"event_id", "provider_id"},
    "ProviderDisconnected": {"event_id", "provider_id"},
    "RouteRequest": {"request_id"},
    "RouteDecision": {"request_id"},
    "Reservation": {"request_id", "provider_id"},
    "Completion": {"event_id", "request_id"},
    "ConfigChange": set(),
    "Tick": {"at_ms"},
    "ModelCapacity": {"model"},
    "DeadLetter": {"original_value"},
}

# The schema id is the type tag on the wire: it never changes for a record.
FROZEN_IDS = {
    "ProviderRegistered": 1, "Heartbeat": 2, "ProviderDisconnected": 3, "RouteRequest": 4,
    "RouteDecision": 5, "Reservation": 6, "Completion": 7, "ConfigChange": 8, "Tick": 9,
    "ModelCapacity": 10, "DeadLetter": 11,
}

# CRC-64-AVRO fingerprints of the parsing canonical form (docs and defaults excluded): the
# binary layout a schema id stands for. A change here breaks decoding of everything already
# written (the journal is kept forever). To evolve a record: give the new version a NEW id,
# keep the old schema to decode old messages, and update this table.
FROZEN_FINGERPRINTS = {
    "ProviderRegistered": "75295c64589b1788",
    "Heartbeat": "9dd7c252d9002a7f",
    "ProviderDisconnected": "374145396252ba63",
    "RouteRequest": "3ff20774a59bd360",
    "RouteDecision": "87fa5f82c43fcb93",
    "Reservation": "382463d57ae7149c",
    "Completion": "cbca4f6f2afb8a6e",
    "ConfigChange": "064e94c1420431b7",
    "Tick": "5226f4d28f1237fa",
    "ModelCapacity": "c1ad5f282f9b5969",
    "DeadLetter": "1e80a209a1fee7c0",
}

NAMES = sorted(FROZEN_IDS)


def sig(t):
    """The schema type in the FROZEN notation."""
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        assert len(t) == 2 and t[0] == "null", f"only [null, T] unions are used: {t}"
        return ["null", sig(t[1])]
    kind = t["type"]
    if kind == "record":
        return {"fields": {f["name"]: sig(f["type"]) for f in t["fields"]}}
    if kind == "array":
        return ["array", sig(t["items"])]
    if kind == "map":
        return ["map", sig(t["values"])]
    return sig(kind)


def assert_compatible(frozen, actual, path):
    if isinstance(frozen, dict):
        assert isinstance(actual, dict), f"{path}: no longer a record"
        names = list(actual["fields"])
        for name, ft in frozen["fields"].items():
            assert name in actual["fields"], f"{path}.{name} was removed or renamed"
            assert_compatible(ft, actual["fields"][name], f"{path}.{name}")
        order = [n for n in names if n in frozen["fields"]]
        assert order == list(frozen["fields"]), f"{path}: fields reordered"
    elif isinstance(frozen, list):
        assert isinstance(actual, list) and actual[0] == frozen[0], f"{path}: {actual} != {frozen}"
        assert_compatible(frozen[1], actual[1], f"{path}<{frozen[0]}>")
    else:
        assert actual == frozen, f"{path}: type {actual} != {frozen}"


def walk_fields(t, path=""):
    """(path, field) for every field of every record reachable from t."""
    if isinstance(t, list):
        for b in t:
            yield from walk_fields(b, path)
    elif isinstance(t, dict):
        kind = t["type"]
        if kind == "record":
            for f in t["fields"]:
                p = f"{path}.{f['name']}" if path else f["name"]
                yield p, f
                yield from walk_fields(f["type"], p)
        elif kind == "array":
            yield from walk_fields(t["items"], path)
        elif kind == "map":
            yield from walk_fields(t["values"], path)


# --------------------------------------------------------------------------- schema tests

def test_ids_json_is_the_frozen_map():
    ids = json.loads((SCHEMA_DIR / "ids.json").read_text())
    assert ids == FROZEN_IDS
    assert dict(codec.SCHEMA_IDS) == FROZEN_IDS
    assert len(set(ids.values())) == len(ids)
    assert sorted(p.stem for p in SCHEMA_DIR.glob("*.avsc")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_schema_file_loads_on_its_own(name, tmp_path):
    # Alone in a directory: no reference to another file's named types.
    shutil.copy(SCHEMA_DIR / f"{name}.avsc", tmp_path)
    sc = load_schema(str(tmp_path / f"{name}.avsc"))
    assert sc["name"] == f"switchyard.{name}"
    raw = json.loads((SCHEMA_DIR / f"{name}.avsc").read_text())
    assert raw["namespace"] == "switchyard" and raw["type"] == "record" and raw["name"] == name
    fastavro.parse_schema(raw, named_schemas={})


@pytest.mark.parametrize("name", NAMES)
def test_schema_keeps_the_frozen_fields(name):
    assert_compatible(FROZEN[name], sig(codec.schema(name)), name)


@pytest.mark.parametrize("name", NAMES)
def test_schema_binary_layout_is_frozen(name):
    fp = fingerprint(to_parsing_canonical_form(codec.schema(name)), "CRC-64-AVRO")
    assert fp == FROZEN_FINGERPRINTS[name], (
        f"{name}.avsc changed its binary layout under schema id {FROZEN_IDS[name]}: give the new "
        "version a new id and keep the old schema for decoding old messages")


@pytest.mark.parametrize("name", NAMES)
def test_defaults(name):
    sc = codec.schema(name)
    top_no_default = {f["name"] for f in sc["fields"] if "default" not in f}
    assert top_no_default == NO_DEFAULT[name]
    for path, f in walk_fields(sc):
        t = f["type"]
        if isinstance(t, list):  # nullable: default null
            assert t[0] == "null" and f.get("default", "missing") is None, path
        if "." in path and "default" not in f:
            assert path.endswith((".id", ".model")), f"{name}.{path} has no default"
        if isinstance(t, dict) and t["type"] == "enum":
            pytest.fail(f"{name}.{path}: enums are plain strings, not Avro enums")
        if "default" in f and f["default"] is not None:
            # the default must be a valid value of the type (JSON form)
            assert fastavro_validate(f["default"], t if not isinstance(t, list) else t[1]), path


def test_topic_types():
    assert codec.TOPIC_TYPES["switchyard.providers"] == {
        "ProviderRegistered", "Heartbeat", "ProviderDisconnected"}
    assert codec.TOPIC_TYPES["switchyard.journal"] == {
        "ProviderRegistered", "Heartbeat", "ProviderDisconnected", "RouteRequest", "Completion",
        "ConfigChange", "Tick"}
    assert set().union(*codec.TOPIC_TYPES.values()) == set(NAMES)


# --------------------------------------------------------------------------- examples

SLOT_EXAMPLE = {
    "model": "gemma-4-26b-qat-4bit", "state": "running", "num_running": 2, "num_waiting": 1,
    "max_concurrency": 4, "active_tokens": 712, "max_tokens_potential": 4096,
    "observed_decode_tps": 22.5, "observed_prefill_tps": 310.25, "active_token_budget_used": 712,
    "active_token_budget_max": 100000, "queued_token_budget": 356, "kv_bytes_per_token": 196608,
    "model_load_time_ms": 8400.0,
}

FULL_EXAMPLES = {
    "ProviderRegistered": {
        "event_id": "reg-box-a", "provider_id": "box-a", "registered_at_ms": 1_700_000_000_000,
        "version": "0.7.5", "account_id": "acct-1", "trust_level": "hardware", "private_only": True,
        "hardware": {"chip_name": "Apple M3 Max", "chip_family": "M3", "chip_tier": "Max",
                     "memory_gb": 64.0, "memory_bandwidth_gbs": 400.0, "gpu_cores": 40},
        "decode_tps": 23.0, "prefill_tps": 276.0,
        "models": [{"id": "gemma-4-26b-qat-4bit", "size_bytes": 15_000_000_000, "min_ram_gb": 24.0,
                    "is_vision": True},
                   {"id": "gpt-oss-20b", "size_bytes": 0, "min_ram_gb": 0.0, "is_vision": False}],
    },
    "Heartbeat": {
        "event_id": "hb-box-a-7", "provider_id": "box-a", "seq": 7, "sent_at_ms": 1_700_000_002_000,
        "status": "serving", "warm_models": ["gemma-4-26b-qat-4bit", "gpt-oss-20b"],
        "system_metrics": {"memory_pressure": 0.42, "cpu_usage": 0.3, "thermal_state": "fair"},
        "backend_capacity": {"total_memory_gb": 64.0, "gpu_memory_active_gb": 31.5,
                             "free_for_load_gb": 20.25,
                             "slots": [SLOT_EXAMPLE, dict(SLOT_EXAMPLE, model="gpt-oss-20b",
                                                          state="idle", num_running=0)]},
    },
    "ProviderDisconnected": {"event_id": "dc-box-a-1", "provider_id": "box-a",
                             "at_ms": 1_700_000_009_000, "reason": "socket_closed"},
    "RouteRequest": {
        "request_id": "r1", "attempt": 1, "model": "gemma-4-26b-qat-4bit", "prompt_tokens": 1200,
        "max_tokens": 512, "max_ttft_ms": 2500.0, "min_decode_tps": 15.0, "account_id": "acct-1",
        "consumer_key": "ck-9", "cache_affinity_key": "conv-42", "self_route_only": False,
        "prefer_owner": True, "requires_vision": True, "allowed_provider_ids": ["box-a", "box-b"],
        "excluded_provider_ids": ["box-c"], "avoid_version": "0.7.4",
        "reply_to": "gateway-1.replies", "sent_at_ms": 1_700_000_003_000,
    },
    "RouteDecision": {
        "request_id": "r1", "attempt": 1, "outcome": "rejected", "provider_id": None,
        "model": "gemma-4-26b-qat-4bit", "reason": "machine_busy", "http_status": 429,
        "retry_after_s": 2, "estimated_ttft_ms": 405.8, "prefill_source": "static",
        "cost_ms": 12042.75, "selected_by": "", "band_members": 0, "candidates": 0,
        "capacity_rejections": 1, "too_large": 0, "ttft_rejections": 0, "journal_offset": 12345,
        "config_id": "0123456789abcdef", "decided_at_ms": 1_700_000_003_001,
    },
    "Reservation": {"request_id": "r1", "attempt": 0, "provider_id": "box-a",
                    "model": "gemma-4-26b-qat-4bit", "tokens": 356, "kv_bytes": 69_992_448,
                    "reserved_at_ms": 1_700_000_003_001, "journal_offset": 12345},
    "Completion": {"event_id": "c-r1-0", "request_id": "r1", "attempt": 0, "provider_id": "box-a",
                   "model": "gemma-4-26b-qat-4bit", "status": "ok", "prompt_tokens": 100,
                   "completion_tokens": 256, "ttft_ms": 612.5,
                   "completed_at_ms": 1_700_000_015_000},
    "ConfigChange": {"config_id": "example-0",
                     "settings": {"EIGENINFERENCE_DEDICATED_MODELS": "gemma-4",
                                  "EIGENINFERENCE_QUEUE_MAX_WAIT": "30s"},
                     "changed_at_ms": 0, "author": "ops@example"},
    "Tick": {"at_ms": 1_700_000_004_000},
    "ModelCapacity": {"model": "gemma-4-26b-qat-4bit", "routable_providers": 2,
                      "remaining_concurrency": 3, "remaining_tokens": 99_000,
                      "estimated_ttft_ms": 768.12, "at_ms": 1_700_000_004_000,
                      "journal_offset": 12346},
    "DeadLetter": {"original_key": b"box-a", "original_value": b"\x00\x00\x00\x00\x63\xff\x01",
                   "topic": "switchyard.providers", "partition": 3, "offset": 991,
                   "reason": "unknown_schema_id", "detail": "99", "at_ms": 1_700_000_005_000},
}


@pytest.mark.parametrize("name", NAMES)
def test_full_example_round_trip(name):
    value = FULL_EXAMPLES[name]
    # the hand-written example really is complete
    assert set(value) == {f["name"] for f in codec.schema(name)["fields"]}
    before = copy.deepcopy(value)
    data = encode(name, value)
    assert value == before, "encode must not mutate its argument"
    assert data[0] == 0 and struct.unpack(">I", data[1:5])[0] == FROZEN_IDS[name]
    assert decode(data) == (name, value)
    assert decode(bytearray(data)) == (name, value)
    assert decode(memoryview(data)) == (name, value)
    assert decode_as(data, {name}) == (name, value)
    assert decode_as(data, name) == (name, value)
    assert codec.peek_type(data) == name
    # The body is plain Avro: standard tooling reads it with the .avsc alone.
    raw = fastavro.parse_schema(json.loads((SCHEMA_DIR / f"{name}.avsc").read_text()))
    assert fastavro.schemaless_reader(io.BytesIO(data[5:]), raw) == value


def test_example_journals_encode():
    for path in Path("/work/shared/spec/examples").glob("*.jsonl"):
        if path.name.endswith(".expected.jsonl"):
            continue
        for line in path.read_text().splitlines():
            obj = json.loads(line)
            name = obj.pop("type")
            got_name, got = decode(encode(name, obj))
            assert got_name == name and got == obj


def test_missing_fields_take_defaults_on_encode():
    _, v = decode(encode("RouteRequest", {"request_id": "r9"}))
    assert v["request_id"] == "r9" and v["attempt"] == 0 and v["account_id"] is None
    assert v["allowed_provider_ids"] == [] and v["max_ttft_ms"] == 0.0 and v["reply_to"] == ""
    _, hb = decode(encode("Heartbeat", {"event_id": "e", "provider_id": "p",
                                        "backend_capacity": {"slots": [{"model": "m"}]}}))
    assert hb["system_metrics"] == {"memory_pressure": 0.0, "cpu_usage": 0.0, "thermal_state": ""}
    assert hb["backend_capacity"]["free_for_load_gb"] is None
    assert hb["backend_capacity"]["slots"][0]["num_running"] == 0
    _, dl = decode(encode("DeadLetter", {"original_value": b""}))
    assert dl["original_key"] is None and dl["detail"] == ""


def test_int_is_accepted_for_double():
    hb = copy.deepcopy(FULL_EXAMPLES["Heartbeat"])
    hb["backend_capacity"]["slots"][0]["model_load_time_ms"] = 0
    _, v = decode(encode("Heartbeat", hb))
    assert v["backend_capacity"]["slots"][0]["model_load_time_ms"] == 0.0
    assert type(v["backend_capacity"]["slots"][0]["model_load_time_ms"]) is float


def test_non_finite_doubles_round_trip():
    r = dict(FULL_EXAMPLES["RouteRequest"], max_ttft_ms=math.inf, min_decode_tps=math.nan)
    _, v = decode(encode("RouteRequest", r))
    assert v["max_ttft_ms"] == math.inf and math.isnan(v["min_decode_tps"])


# --------------------------------------------------------------------------- hypothesis

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=24)


def strategy(t):
    if isinstance(t, str):
        return {
            "string": TEXT,
            "long": st.integers(-(2**63), 2**63 - 1),
            "double": st.floats(allow_nan=False),
            "boolean": st.booleans(),
            "bytes": st.binary(max_size=40),
            "null": st.none(),
        }[t]
    if isinstance(t, list):
        return st.one_of(*[strategy(b) for b in t])
    kind = t["type"]
    if kind == "record":
        return st.fixed_dictionaries({f["name"]: strategy(f["type"]) for f in t["fields"]})
    if kind == "array":
        return st.lists(strategy(t["items"]), max_size=4)
    if kind == "map":
        return st.dictionaries(TEXT, strategy(t["values"]), max_size=4)
    return strategy(kind)


RECORDS = st.sampled_from(NAMES).flatmap(
    lambda n: st.tuples(st.just(n), strategy(codec.schema(n))))

# Values that are wrong for most types.
JUNK = st.sampled_from([None, True, False, 1.5, -1, 2**63, -(2**63) - 1, "x", b"x", [], {}, [1],
                        {"k": 1}, {1: "v"}, ("a",), object()])


@settings(max_examples=300, deadline=None)
@given(RECORDS)
def test_round_trip_generated(nv):
    name, value = nv
    assert decode(encode(name, value)) == (name, value)


def _leaves(v, path=()):
    yield path
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _leaves(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _leaves(x, path + (i,))


def _replace(v, path, new):
    if not path:
        return new
    v = copy.copy(v)
    v[path[0]] = _replace(v[path[0]], path[1:], new)
    return v


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(RECORDS, st.data(), JUNK)
def test_encode_accepts_only_what_round_trips(nv, data, junk):
    """Corrupt one spot of a valid value: encode either rejects it with CodecError, or the value
    is valid for fastavro too and decodes to itself (ints in double fields become floats)."""
    name, value = nv
    paths = list(_leaves(value))
    path = data.draw(st.sampled_from(paths))
    bad = _replace(value, path, junk)
    try:
        out = encode(name, bad)
    except CodecError as e:
        assert e.reason == "invalid_value"
        return
    assert fastavro_validate(bad, codec.schema(name), raise_errors=False)
    got_name, got = decode(out)
    assert got_name == name
    assert got == expected_after_round_trip(codec.schema(name), bad)


def expected_after_round_trip(t, v):
    """What Avro gives back for an accepted value: defaults filled, ints in doubles as floats."""
    if isinstance(t, str):
        return float(v) if t == "double" else v
    if isinstance(t, list):
        return None if v is None else expected_after_round_trip(t[1], v)
    kind = t["type"]
    if kind == "record":
        return {f["name"]: expected_after_round_trip(f["type"], v[f["name"]] if f["name"] in v
                                                      else copy.deepcopy(f["default"]))
                for f in t["fields"]}
    if kind == "array":
        return [expected_after_round_trip(t["items"], x) for x in v]
    if kind == "map":
        return {k: expected_after_round_trip(t["values"], x) for k, x in v.items()}
    return expected_after_round_trip(kind, v)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_raises_only_codec_error(blob):
    for data in (blob, b"\x00" + blob, b"\x00\x00\x00\x00" + blob):
        try:
            name, value = decode(data)
        except CodecError as e:
            assert e.reason in codec.REASONS
        else:
            assert name in NAMES and isinstance(value, dict)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(NAMES), st.binary(max_size=80))
def test_random_body_behind_a_valid_header(name, body):
    data = struct.pack(">BI", 0, FROZEN_IDS[name]) + body
    try:
        got_name, value = decode(data)
    except CodecError as e:
        assert e.reason in {"truncated", "malformed_avro", "trailing_bytes"}
    else:
        assert got_name == name
        encode(name, value)  # whatever decodes is a valid value


@settings(max_examples=300, deadline=None)
@given(RECORDS, st.data())
def test_mutated_messages_raise_only_codec_error(nv, data):
    name, value = nv
    msg = bytearray(encode(name, value))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(msg) - 1))
        msg[i] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(msg))
    except CodecError as e:
        assert e.reason in codec.REASONS


# --------------------------------------------------------------------------- malformed input

def reason_of(data, expected=None):
    with pytest.raises(CodecError) as ei:
        if expected is None:
            decode(data)
        else:
            decode_as(data, expected)
    assert isinstance(ei.value, ValueError)
    return ei.value.reason


@pytest.mark.parametrize("name", NAMES)
def test_every_prefix_is_truncated(name):
    data = encode(name, FULL_EXAMPLES[name])
    assert reason_of(b"") == "empty"
    for n in range(1, len(data)):
        assert reason_of(data[:n]) == "truncated", n


def test_empty_and_not_bytes():
    assert reason_of(None) == "empty"
    assert reason_of(b"") == "empty"
    assert reason_of("\x00\x00\x00\x00\x09\x02") == "not_bytes"
    assert reason_of(12) == "not_bytes"


@pytest.mark.parametrize("magic", [1, 2, 0x7F, 0x80, 0xFF])
def test_wrong_magic_byte(magic):
    data = bytearray(encode("Tick", {"at_ms": 5}))
    data[0] = magic
    assert reason_of(bytes(data)) == "bad_magic"
    assert reason_of(bytes([magic])) == "bad_magic"


@pytest.mark.parametrize("sid", [0, 12, 255, 2**31, 2**32 - 1])
def test_unknown_schema_id(sid):
    assert reason_of(struct.pack(">BI", 0, sid) + b"\x02") == "unknown_schema_id"


def test_trailing_bytes():
    data = encode("Tick", {"at_ms": 5})
    assert reason_of(data + b"\x00") == "trailing_bytes"
    assert reason_of(encode("Heartbeat", FULL_EXAMPLES["Heartbeat"]) + b"junk") == "trailing_bytes"


def test_decode_as_checks_the_type():
    data = encode("Tick", {"at_ms": 5})
    assert reason_of(data, {"Heartbeat", "ProviderRegistered"}) == "unexpected_type"
    assert reason_of(data, "Heartbeat") == "unexpected_type"
    assert reason_of(data, codec.TOPIC_TYPES["switchyard.providers"]) == "unexpected_type"
    assert decode_as(data, codec.TOPIC_TYPES["switchyard.journal"]) == ("Tick", {"at_ms": 5})
    # header problems win over the type check
    assert reason_of(b"\x01" + data[1:], "Tick") == "bad_magic"


def test_oversized():
    big = struct.pack(">BI", 0, FROZEN_IDS["ConfigChange"]) + b"\x00" * codec.MAX_MESSAGE_BYTES
    assert reason_of(big) == "oversized"
    with pytest.raises(CodecError) as ei:
        encode("ConfigChange", {"settings": {"K": "v" * codec.MAX_MESSAGE_BYTES}})
    assert ei.value.reason == "oversized"


def test_bad_utf8_is_malformed():
    # Tick has no strings; ProviderDisconnected starts with event_id: a 2-byte invalid string.
    data = struct.pack(">BI", 0, FROZEN_IDS["ProviderDisconnected"]) + b"\x04\xff\xfe" + b"\x00\x00\x00"
    assert reason_of(data) == "malformed_avro"


def zigzag(n):
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame(name, body):
    return struct.pack(">BI", 0, FROZEN_IDS[name]) + body


EMPTY = zigzag(0)  # an empty string, a zero long, an empty array/map end marker

HOSTILE = {
    # Heartbeat: event_id, provider_id, seq, sent_at_ms, status, warm_models ...
    "huge_string": frame("Heartbeat", zigzag(2**40) + b"abc"),
    "huge_string_2^62": frame("Heartbeat", zigzag(2**62) + b"abc"),
    "negative_string": frame("Heartbeat", zigzag(-3) + b"abcdef" * 4),
    "huge_array": frame("Heartbeat", EMPTY * 5 + zigzag(2**40) + b"\x02a\x02b"),
    "huge_array_2^62": frame("Heartbeat", EMPTY * 5 + zigzag(2**62) + b"\x02a"),
    "huge_negative_block": frame("Heartbeat", EMPTY * 5 + zigzag(-(2**40)) + zigzag(2**40) + b"\x02a"),
    "huge_record_array": frame("ProviderRegistered",
                               EMPTY * 3 + b"\x00" * 3 + b"\x00" * 4 + b"\x00" * 16 + b"\x00"
                               + b"\x00" * 16 + zigzag(2**40) + b"\x02a"),
    "huge_map": frame("ConfigChange", EMPTY + zigzag(2**40) + b"\x02k\x02v"),
    "huge_bytes": frame("DeadLetter", b"\x02" + zigzag(2**40) + b"xyz"),
    "huge_value_bytes": frame("DeadLetter", b"\x00" + zigzag(2**40) + b"xyz"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_huge_claimed_lengths_fail_fast(case):
    data = HOSTILE[case]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        reason = reason_of(data)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert reason == "truncated"
    assert time.perf_counter() - t0 < 1.0
    assert peak < 10 * 2**20, f"{case} allocated {peak} bytes"


def test_huge_array_in_a_full_size_message_is_bounded():
    """A claimed 2**40 empty strings backed by a full 1 MiB of zero bytes: decoding stops at the
    end of the message (each item costs at least one byte)."""
    body = EMPTY * 5 + zigzag(2**40)
    data = frame("Heartbeat", body)
    data += b"\x00" * (codec.MAX_MESSAGE_BYTES - len(data))
    t0 = time.perf_counter()
    assert reason_of(data) == "truncated"
    assert time.perf_counter() - t0 < 5.0


def test_overlong_varint_raises_only_codec_error():
    for body in (b"\xff" * 11 + b"\x01", b"\x80" * 20 + b"\x00", b"\xff" * 30):
        try:
            decode(frame("Tick", body))
        except CodecError as e:
            assert e.reason in {"truncated", "malformed_avro", "trailing_bytes"}


# --------------------------------------------------------------------------- invalid values

@pytest.mark.parametrize("name,value,where", [
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], seq=1.5), "seq"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], seq=True), "seq"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], seq="7"), "seq"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], seq=2**63), "seq"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], seq=None), "seq"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], warm_models="abc"), "warm_models"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], warm_models=("a",)), "warm_models"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], provider_id="\ud800"), "surrogates"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], sequence=1), "sequence"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"],
                       system_metrics={"cpu_usage": True}), "cpu_usage"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"],
                       backend_capacity={"slots": [{"model": "m", "num_running": 1.0}]}), "num_running"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], backend_capacity={"slots": [{}]}), "model"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], backend_capacity={"extra": 1}), "extra"),
    ("Heartbeat", dict(FULL_EXAMPLES["Heartbeat"], backend_capacity=[]), "backend_capacity"),
    ("Tick", {}, "at_ms"),
    ("Tick", {"at_ms": 1.0}, "at_ms"),
    ("Tick", [("at_ms", 1)], "record"),
    ("RouteRequest", dict(FULL_EXAMPLES["RouteRequest"], max_ttft_ms="1"), "max_ttft_ms"),
    ("RouteRequest", dict(FULL_EXAMPLES["RouteRequest"], max_ttft_ms=False), "max_ttft_ms"),
    ("RouteRequest", dict(FULL_EXAMPLES["RouteRequest"], account_id=5), "account_id"),
    ("RouteRequest", dict(FULL_EXAMPLES["RouteRequest"], requires_vision=1), "requires_vision"),
    ("ConfigChange", {"settings": {"K": 1}}, "settings"),
    ("ConfigChange", {"settings": {1: "v"}}, "settings"),
    ("DeadLetter", {"original_value": "text"}, "original_value"),
    ("RouteDecision", dict(FULL_EXAMPLES["RouteDecision"], retry_after_s=2.0), "retry_after_s"),
])
def test_invalid_values(name, value, where):
    with pytest.raises(CodecError) as ei:
        encode(name, value)
    assert ei.value.reason == "invalid_value"
    assert where in str(ei.value)
    with pytest.raises(CodecError):
        codec.validate(name, value)


def test_unknown_record_name():
    for bad in ("Nope", None, 3):
        with pytest.raises(CodecError) as ei:
            encode(bad, {})
        assert ei.value.reason == "unknown_type"
    with pytest.raises(CodecError):
        codec.schema("Nope")


def test_encode_does_not_mutate_nullable_record():
    hb = copy.deepcopy(FULL_EXAMPLES["Heartbeat"])
    encode("Heartbeat", hb)
    assert isinstance(hb["backend_capacity"], dict)
    assert hb == FULL_EXAMPLES["Heartbeat"]
    legacy = dict(hb, backend_capacity=None)
    assert decode(encode("Heartbeat", legacy))[1]["backend_capacity"] is None


def test_error_is_a_value_error_with_reason():
    e = CodecError("truncated", "x")
    assert isinstance(e, ValueError) and e.reason == "truncated" and e.detail == "x"
    assert str(e) == "truncated: x"
    assert "truncated" in codec.REASONS
