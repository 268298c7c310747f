"""`python -m replay` — re-run, export, audit and explain Switchyard journals.

  python -m replay run     --journal FILE.jsonl --out decisions.jsonl   (or FILE.avro from export --avro)
  python -m replay export  --bootstrap HOST:PORT --out journal.jsonl [--decisions-topic T] [--avro FILE]
  python -m replay audit   --journal FILE.jsonl              (recorded decisions are lines of the file)
  python -m replay audit   --bootstrap HOST:PORT --decisions-topic switchyard.decisions
  python -m replay explain REQUEST_ID --journal FILE.jsonl [--json]
  python -m replay what-if --journal FILE.jsonl --set EIGENINFERENCE_SATISFICING_BAND=true --report out/w.md

A journal comes from a file (--journal: JSON Lines, or the Avro container `export --avro` writes,
the faster to read) or from Kafka (--bootstrap, --topic, --partition). It is read as it is replayed,
so a day's journal needs memory for the router's state only (an audit also holds the decisions;
what-if holds the journal: it makes two passes).
Replays start from the default settings and apply the journal's ConfigChange entries (rules §3).
"""
from __future__ import annotations

import argparse
import json
import sys

from streams.config import Config, ConfigError
from streams.jsonl import write_record
from streams.kafka_security import KafkaSecurity, KafkaSecurityError

from . import audit as audit_mod
from .child_process import WriteInChild
from . import explain as explain_mod
from .run import batch_gc, decisions, replay
from .sources import JournalIncomplete, JournalStream, KafkaJournal, container_schema, kafka_decisions, kafka_records


def _source(args):
    """The journal's input entries, read as they are iterated (once). After that, `count` is the
    entries read, `recorded` the file's recorded decisions (None from Kafka) and `skipped` the
    skipped lines by reason."""
    if args.journal:
        return JournalStream(args.journal)
    if not args.bootstrap:
        sys.exit("give --journal FILE or --bootstrap HOST:PORT")
    return KafkaJournal(args.bootstrap, args.topic, args.partition, end=args.end_offset, from_first=True,
                        security=args.security)


def _add_source_args(p, journal_required=False):
    p.add_argument("--journal", help="journal file: JSON Lines, or an Avro container from `export --avro`")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers, to read the journal topic instead")
    p.add_argument("--topic", default="switchyard.journal", help="journal topic (default %(default)s)")
    p.add_argument("--partition", type=int, default=0, help="journal partition = routing domain")
    # No --start-offset: a replay starts from the initial state, so it reads from offset 0.
    p.add_argument("--end-offset", type=int, help="offset to stop before (Kafka)")


def cmd_run(args) -> int:
    entries = _source(args)
    n = 0
    with WriteInChild(args.out if args.out and args.out != "-" else None) as out:
        for d in decisions(entries):
            out.write("RouteDecision", d)
            n += 1
    note = f"; skipped lines: {dict(entries.skipped)}" if entries.skipped else ""
    print(f"{n} decisions from {entries.count} journal entries{note}", file=sys.stderr)
    if entries.count == 0:
        return _refuse("the journal has no entries (the wrong --topic, or the wrong file?)")
    return 0


def cmd_export(args) -> int:
    from fastavro.write import Writer
    from streams import codec
    records = kafka_records(args.bootstrap, args.topic, args.partition, start=args.start_offset,
                            end=args.end_offset, start_ms=args.start_ms, end_ms=args.end_ms,
                            security=args.security)
    avro = open(args.avro, "wb") if args.avro else None
    n, first = 0, True
    try:
        container = Writer(avro, container_schema()) if avro else None  # written as it is read
        with open(args.out, "w") as fp:
            for rec in records:
                if first and rec.offset > 0 and args.start_offset is None and args.start_ms is None:
                    print(f"note: the journal begins at offset {rec.offset}, not 0 (its first entries were "
                          "deleted): a replay of this export will refuse it", file=sys.stderr)
                first = False
                try:
                    name, value = codec.decode(rec.value)
                except codec.CodecError as e:
                    print(f"offset {rec.offset}: undecodable ({e.reason}), skipped", file=sys.stderr)
                    continue
                write_record(fp, name, value, journal_offset=rec.offset, journal_time_ms=rec.timestamp)
                if container:
                    container.write({"journal_offset": rec.offset, "journal_time_ms": rec.timestamp,
                                     "event": (f"switchyard.{name}", value)})
                n += 1
            for topic in args.decisions_topic or ():
                for d in kafka_decisions(args.bootstrap, topic, args.security):
                    write_record(fp, "RouteDecision", d)
        if container:
            container.flush()
    finally:
        if avro:
            avro.close()
    print(f"exported {n} journal entries to {args.out}", file=sys.stderr)
    return 0


def cmd_audit(args) -> int:
    if args.decisions_topic and not args.bootstrap:
        return _refuse("--decisions-topic needs --bootstrap (the broker to read it from)")
    entries = _source(args)
    if entries.recorded is None and not args.decisions_topic:
        return _refuse("no recorded decisions: give a journal file with RouteDecision lines or --decisions-topic")
    last = -1
    replayed = []
    for entry, outputs in replay(entries):  # a file's recorded decisions are complete after this
        last = entry.journal_offset
        replayed += [record for kind, record in outputs if kind == "RouteDecision"]
    if entries.count == 0:
        return _refuse("the journal has no entries: nothing to audit")
    if args.decisions_topic:
        recorded = [d for topic in args.decisions_topic for d in kafka_decisions(args.bootstrap, topic, args.security)]
    elif not entries.recorded:
        return _refuse("the journal file has no RouteDecision lines to compare with: export it with "
                       "--decisions-topic, or give --bootstrap and --decisions-topic")
    else:
        recorded = entries.recorded
    later = [d for d in recorded if d["journal_offset"] > last]  # decided on entries not replayed
    if later:
        recorded = [d for d in recorded if d["journal_offset"] <= last]
        print(f"{len(later)} recorded decisions of entries after the journal's last replayed offset {last}: "
              "not compared", file=sys.stderr)
    if entries.skipped:
        print(f"skipped lines: {dict(entries.skipped)}", file=sys.stderr)
    report = audit_mod.compare(recorded, replayed)
    print(report.summary())
    return 0 if report.ok else 1


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_explain(args) -> int:
    entries = _source(args)
    report = explain_mod.explain(entries, args.request_id, args.attempt)
    if report is None:
        print(f"request {args.request_id} not found in the journal", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else explain_mod.render(report))
    return 0


def cmd_whatif(args) -> int:
    from tqdm import tqdm

    from .report import compare_runs, write_report
    from .whatif import what_if
    settings = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            return _refuse(f"--set wants NAME=VALUE, got {item!r}")
        name = name if name.startswith("EIGENINFERENCE_") else "EIGENINFERENCE_" + name
        settings[name] = value
    try:
        Config().patched(settings)  # before the journal is read: refused as the router would
    except ConfigError as e:
        return _refuse(f"--set refused: {e}")
    entries = list(_source(args))  # two passes: the recorded run, then the what-if
    if not entries:
        return _refuse("the journal has no entries (the wrong --topic, or the wrong file?)")
    with tqdm(total=2 * len(entries), unit="entry", desc="what-if", disable=args.quiet) as bar:
        result = what_if(entries, settings, progress=bar)
    comparison = compare_runs(result.recorded.decisions, result.whatif.decisions, result.providers)
    path = write_report(args.report, comparison, title="What-if report", settings=settings,
                        method=result.method, journal=args.journal or f"{args.bootstrap}/{args.topic}",
                        entries=result.entries)
    for model, runs in comparison.items():
        rec, wi = runs["recorded"], runs["whatif"]
        print(f"{model}: outcomes {rec['outcomes']} -> {wi['outcomes']}; top-10% share "
              f"{rec['top10_share']:.1%} -> {wi['top10_share']:.1%}; idle providers "
              f"{rec['idle_share']:.1%} -> {wi['idle_share']:.1%}")
    print(f"report: {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="re-run a journal from a fresh state and write its decisions")
    _add_source_args(p)
    p.add_argument("--out", default="-", help="decisions as JSON Lines (default stdout)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("export", help="copy a journal topic partition from Kafka to a file")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", default="switchyard.journal")
    p.add_argument("--partition", type=int, default=0)
    p.add_argument("--start-offset", type=int, help="first offset (a window to look at: a replay needs offset 0 on)")
    p.add_argument("--end-offset", type=int)
    p.add_argument("--start-ms", type=int, help="first entry at or after this time (ms since epoch)")
    p.add_argument("--end-ms", type=int, help="stop at entries at or after this time")
    p.add_argument("--out", required=True, help="JSON Lines file")
    p.add_argument("--decisions-topic", action="append",
                   help="also copy the recorded decisions of this topic (for a standalone audit; repeatable)")
    p.add_argument("--avro", help="also write an Avro object container file")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("audit", help="re-run a journal and compare every decision with the recorded one")
    _add_source_args(p)
    p.add_argument("--decisions-topic", action="append",
                   help="read the recorded decisions from this topic (repeatable: private reply topics too)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("explain", help="why a request went where it went (or was rejected)")
    p.add_argument("request_id")
    p.add_argument("--attempt", type=int)
    _add_source_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("what-if", help="re-run the journal under changed settings and report the difference")
    _add_source_args(p)
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="a setting to change (EIGENINFERENCE_ prefix optional); repeatable")
    p.add_argument("--report", default="out/whatif.md", help="Markdown report path (PNG plots beside it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_whatif)

    args = ap.parse_args(argv)
    batch_gc()
    try:
        args.security = KafkaSecurity.from_env()  # for --bootstrap: KAFKA_SECURITY_PROTOCOL, ... (docs/security.md)
        return args.func(args)
    except (KafkaSecurityError, JournalIncomplete) as e:
        return _refuse(str(e))
    except OSError as e:  # a journal file that is not there, a directory, unreadable
        return _refuse(f"{e.strerror or e}: {e.filename or ''}".rstrip(": "))


if __name__ == "__main__":
    sys.exit(main())
