"""Operator command line for a running Switchyard: ask for a route, change settings, watch decisions.

    python -m streams.cli route --model gpt-oss-20b --prompt-tokens 1200 [--max-tokens 512]
    python -m streams.cli config set EIGENINFERENCE_SATISFICING_BAND=true QUEUE_MAX_DEPTH=20
    python -m streams.cli tail decisions [--from-beginning] [--limit 100]

Owns argument parsing and JSON output only; the Kafka side is `streams.client`. Every command takes
`--bootstrap` (default $KAFKA_BOOTSTRAP_SERVERS, else 127.0.0.1:9092) and `--topic-prefix` (default
$SWITCHYARD_TOPIC_PREFIX, else none), which must match the worker's.
"""
from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import socket
import sys

from aiokafka.errors import KafkaError

from . import codec
from .client import DECISIONS, GatewayClient, normalise_settings, publish_config, read_decisions
from .config import NAMES, ConfigError
from .kafka_security import KafkaSecurity, KafkaSecurityError

EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE = 0, 1, 2  # 1 also: the broker or a topic not there


def _print(record: dict) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)


async def cmd_route(args) -> int:
    request = {"model": args.model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "max_ttft_ms": args.max_ttft_ms, "min_decode_tps": args.min_decode_tps,
               "allowed_provider_ids": args.allow or [], "excluded_provider_ids": args.exclude or []}
    if args.request_id:
        request["request_id"] = args.request_id
    if args.account:
        request["account_id"] = args.account
    try:
        gateway = GatewayClient(args.bootstrap, topic_prefix=args.topic_prefix, reply_topic=args.reply_topic,
                                security=args.security)
        codec.encode("RouteRequest", gateway.fill_request(request))  # checked before anything is sent
    except ValueError as e:  # a CodecError too
        print(f"refused: {e}", file=sys.stderr)
        return EXIT_USAGE
    async with gateway as gw:
        try:
            decision = await gw.route(request, timeout=args.timeout)
        except asyncio.TimeoutError:
            again = " A request id and attempt decided before are not decided again." if args.request_id else ""
            print(f"no decision within {args.timeout:g}s (is a worker running with topic prefix "
                  f"{args.topic_prefix!r} on {args.bootstrap}?).{again}", file=sys.stderr)
            return EXIT_TIMEOUT
        _print(decision)
        if decision["outcome"] == "queued" and not args.no_wait:
            try:
                _print(await gw.follow_up(decision["request_id"], decision["attempt"],
                                          timeout=args.queue_timeout))
            except asyncio.TimeoutError:
                print(f"queued; no second decision within {args.queue_timeout:g}s", file=sys.stderr)
                return EXIT_TIMEOUT
    return EXIT_OK


def parse_assignments(items: list[str]) -> dict[str, str]:
    settings = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected NAME=VALUE, got {item!r}")
        settings[name.strip()] = value
    return settings


async def cmd_config_set(args) -> int:
    try:
        settings = normalise_settings(parse_assignments(args.assignments))
    except (ValueError, ConfigError) as e:
        print(f"refused: {e}", file=sys.stderr)
        return EXIT_USAGE
    record = await publish_config(args.bootstrap, settings, topic_prefix=args.topic_prefix,
                                  author=args.author, security=args.security)
    _print(record)
    return EXIT_OK


async def cmd_tail(args) -> int:
    topic = args.topic or args.topic_prefix + DECISIONS
    async for decision in read_decisions(args.bootstrap, topic, from_beginning=args.from_beginning,
                                         limit=args.limit, idle_timeout=args.idle_exit,
                                         security=args.security):
        _print(decision)
    return EXIT_OK


def _default_author() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()} via streams.cli"
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "streams.cli"


def _add_common(parser: argparse.ArgumentParser, top: bool) -> None:
    # Accepted before and after the command; below the top level the default is SUPPRESS so a
    # subcommand does not overwrite a value given before it.
    dflt = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default=dflt(os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")),
                        help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092)")
    parser.add_argument("--topic-prefix", default=dflt(os.environ.get("SWITCHYARD_TOPIC_PREFIX", "")),
                        help="prefix of every topic name, as the worker's SWITCHYARD_TOPIC_PREFIX "
                             "(default: $SWITCHYARD_TOPIC_PREFIX or none)")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, top=False)

    parser = argparse.ArgumentParser(
        prog="python -m streams.cli",
        description=__doc__.split("Owns")[0].strip(),
        epilog="Exit status: 0 ok, 1 no decision in time (or no broker, or no such topic), 2 bad "
               "arguments, settings or request fields.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    route = sub.add_parser(
        "route", parents=[common], help="send one RouteRequest and print its decision as JSON",
        description="Publish a RouteRequest and print the RouteDecision as one JSON line. A queued "
                    "request (202) prints a second line when it leaves the queue, unless --no-wait.")
    route.add_argument("--model", required=True, help="model id, e.g. gpt-oss-20b")
    route.add_argument("--prompt-tokens", type=int, required=True, help="estimated prompt tokens")
    route.add_argument("--max-tokens", type=int, default=0, help="max output tokens (0 = the router's 256)")
    route.add_argument("--max-ttft-ms", type=float, default=0.0, help="hard TTFT ceiling (0 = none)")
    route.add_argument("--min-decode-tps", type=float, default=0.0, help="decode floor (0 = the setting)")
    route.add_argument("--account", help="account id of the caller")
    route.add_argument("--allow", action="append", metavar="PROVIDER", help="only these providers (repeat)")
    route.add_argument("--exclude", action="append", metavar="PROVIDER", help="never these providers (repeat)")
    route.add_argument("--request-id", help="request id (default: a new uuid)")
    route.add_argument("--reply-topic", help="reply topic (default: <prefix>switchyard.decisions)")
    route.add_argument("--timeout", type=positive, default=10.0, help="seconds to wait for the decision (10)")
    route.add_argument("--queue-timeout", type=positive, default=60.0,
                       help="seconds to wait for a queued request's second decision (60)")
    route.add_argument("--no-wait", action="store_true", help="do not wait for a queued request's second decision")
    route.set_defaults(run=cmd_route)

    config = sub.add_parser("config", parents=[common], help="change routing settings",
                            description="Routing settings, changed through the journal.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    cset = config_sub.add_parser(
        "set", parents=[common], help="publish a ConfigChange patch",
        description="Publish a ConfigChange: each NAME=VALUE replaces that setting, NAME= (empty) "
                    "resets it to its default, settings not named stay as they are. NAME may omit the "
                    "EIGENINFERENCE_ prefix. Values are checked before anything is sent. A change lasts "
                    "until the next one, across worker restarts, unless a worker starts with other "
                    "EIGENINFERENCE_* settings in its environment (its own then replace all).",
        epilog="Settings: " + ", ".join(NAMES))
    cset.add_argument("assignments", nargs="+", metavar="NAME=VALUE")
    cset.add_argument("--author", default=_default_author(), help="recorded with the change")
    cset.set_defaults(run=cmd_config_set)

    tail = sub.add_parser("tail", parents=[common], help="print decisions as JSON lines",
                          description="Print RouteDecisions as JSON lines as they are published.")
    tail.add_argument("what", choices=["decisions"], help="what to tail")
    tail.add_argument("--from-beginning", action="store_true", help="start at the topic's first record")
    tail.add_argument("--limit", type=lambda v: int(positive(v)), help="stop after N decisions")
    tail.add_argument("--idle-exit", type=positive, metavar="SECONDS",
                      help="stop when nothing arrived for SECONDS (default: follow until Ctrl-C)")
    tail.add_argument("--topic", help="read this topic instead (e.g. a gateway's private reply topic)")
    tail.set_defaults(run=cmd_tail)
    return parser


def positive(value: str) -> float:
    number = float(value)
    if not number > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return number


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.security = KafkaSecurity.from_env()  # KAFKA_SECURITY_PROTOCOL, ... (docs/security.md)
    except KafkaSecurityError as e:
        print(f"refused: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(args.run(args))
    except KeyboardInterrupt:
        return EXIT_OK
    except (KafkaError, RuntimeError) as e:  # the broker unreachable, a topic that is not there
        print(f"error: {e} (bootstrap {args.bootstrap}, topic prefix {args.topic_prefix!r})", file=sys.stderr)
        return EXIT_TIMEOUT


if __name__ == "__main__":
    sys.exit(main())
