"""How Switchyard's Kafka clients authenticate: SASL (PLAIN, SCRAM-SHA-256/512) and TLS settings.

One place reads the connection-security settings from the environment and turns them into what
each client library wants:

* ``faust_credentials()`` — the Faust app's ``broker_credentials`` (``faust.SASLCredentials`` or
  ``faust.SSLCredentials``; faust-streaming hands them to every aiokafka consumer, producer and
  topic-creating client it makes);
* ``aiokafka_kwargs()`` — keyword arguments for our own ``AIOKafkaProducer`` /
  ``AIOKafkaConsumer`` / ``AIOKafkaAdminClient``.

Environment (all optional; nothing set means PLAINTEXT, as before):

  KAFKA_SECURITY_PROTOCOL  PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL   (default PLAINTEXT)
  KAFKA_SASL_MECHANISM     PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512          (default PLAIN; SASL_* only)
  KAFKA_SASL_USERNAME      SASL user name                                 (required for SASL_*)
  KAFKA_SASL_PASSWORD      SASL password                                  (required for SASL_*)
  KAFKA_SSL_CAFILE         PEM file with the CA that signed the broker's certificate
                           (SSL / SASL_SSL; default: the system's trust store)

TLS always verifies the broker's certificate and host name (aiokafka's ``create_ssl_context``).
Misconfigurations — an unknown protocol or mechanism, SASL without a user or password, credentials
or a CA file given for a protocol that would ignore them, a missing CA file — raise
``KafkaSecurityError`` when the settings are read, not at the first connection.

The ACLs each Switchyard principal needs are listed by ``switchyard_acls()`` (used by the local
broker in ``streams.broker`` and documented in ``docs/security.md``).
"""
from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, NamedTuple

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SSL_PROTOCOLS = frozenset({"SSL", "SASL_SSL"})
SASL_PROTOCOLS = frozenset({"SASL_PLAINTEXT", "SASL_SSL"})

ENV_PROTOCOL = "KAFKA_SECURITY_PROTOCOL"
ENV_MECHANISM = "KAFKA_SASL_MECHANISM"
ENV_USERNAME = "KAFKA_SASL_USERNAME"
ENV_PASSWORD = "KAFKA_SASL_PASSWORD"
ENV_CAFILE = "KAFKA_SSL_CAFILE"
ENV_NAMES = (ENV_PROTOCOL, ENV_MECHANISM, ENV_USERNAME, ENV_PASSWORD, ENV_CAFILE)


class KafkaSecurityError(ValueError):
    """The Kafka security settings are inconsistent or incomplete."""


@dataclass(frozen=True)
class KafkaSecurity:
    """Connection-security settings of one Kafka client identity."""

    protocol: str = "PLAINTEXT"
    mechanism: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    cafile: str | None = None

    def __post_init__(self) -> None:
        protocol = (self.protocol or "PLAINTEXT").strip().upper()
        object.__setattr__(self, "protocol", protocol)
        if protocol not in PROTOCOLS:
            raise KafkaSecurityError(f"{ENV_PROTOCOL}={self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        sasl = protocol in SASL_PROTOCOLS
        mechanism = (self.mechanism or "").strip().upper() or None
        if sasl:
            mechanism = mechanism or "PLAIN"
            if mechanism not in MECHANISMS:
                raise KafkaSecurityError(
                    f"{ENV_MECHANISM}={self.mechanism!r}: expected one of {', '.join(MECHANISMS)}")
            if not self.username or self.password is None or self.password == "":
                raise KafkaSecurityError(
                    f"{ENV_PROTOCOL}={protocol} needs {ENV_USERNAME} and {ENV_PASSWORD}")
        else:
            given = [name for name, v in ((ENV_MECHANISM, mechanism), (ENV_USERNAME, self.username),
                                          (ENV_PASSWORD, self.password)) if v]
            if given:  # would be silently ignored: almost certainly a mistake
                raise KafkaSecurityError(
                    f"{', '.join(given)} set but {ENV_PROTOCOL}={protocol} does not use SASL "
                    f"(use SASL_SSL or SASL_PLAINTEXT)")
        object.__setattr__(self, "mechanism", mechanism)
        cafile = self.cafile or None
        if cafile is not None:
            if protocol not in SSL_PROTOCOLS:
                raise KafkaSecurityError(f"{ENV_CAFILE} set but {ENV_PROTOCOL}={protocol} does not use TLS")
            if not Path(cafile).is_file():
                raise KafkaSecurityError(f"{ENV_CAFILE}={cafile!r}: no such file")
            cafile = str(cafile)
        object.__setattr__(self, "cafile", cafile)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KafkaSecurity":
        env = os.environ if environ is None else environ
        return cls(protocol=env.get(ENV_PROTOCOL) or "PLAINTEXT", mechanism=env.get(ENV_MECHANISM) or None,
                   username=env.get(ENV_USERNAME) or None, password=env.get(ENV_PASSWORD) or None,
                   cafile=env.get(ENV_CAFILE) or None)

    def env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings (e.g. for a child worker)."""
        out = {ENV_PROTOCOL: self.protocol}
        if self.sasl:
            out.update({ENV_MECHANISM: self.mechanism, ENV_USERNAME: self.username,
                        ENV_PASSWORD: self.password})
        if self.cafile:
            out[ENV_CAFILE] = self.cafile
        return out

    # -- properties ----------------------------------------------------------------------------
    @property
    def tls(self) -> bool:
        return self.protocol in SSL_PROTOCOLS

    @property
    def sasl(self) -> bool:
        return self.protocol in SASL_PROTOCOLS

    @cached_property
    def ssl_context(self) -> ssl.SSLContext | None:
        """A verifying client TLS context (CA file, else the system trust store), or None."""
        if not self.tls:
            return None
        from aiokafka.helpers import create_ssl_context

        return create_ssl_context(cafile=self.cafile)

    # -- what the client libraries want ---------------------------------------------------------
    def aiokafka_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for AIOKafkaProducer / AIOKafkaConsumer / AIOKafkaAdminClient."""
        kw: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            kw["ssl_context"] = self.ssl_context
        if self.sasl:
            kw.update(sasl_mechanism=self.mechanism, sasl_plain_username=self.username,
                      sasl_plain_password=self.password)
        return kw

    def faust_credentials(self):
        """The Faust app's ``broker_credentials``: None for PLAINTEXT.

        faust-streaming 0.15.3 maps ``SASLCredentials`` to aiokafka's ``security_protocol``
        (SASL_SSL when it has an ssl_context, else SASL_PLAINTEXT), ``sasl_mechanism`` (its
        SASLMechanism enum accepts PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), ``sasl_plain_username``,
        ``sasl_plain_password`` and ``ssl_context`` — for the consumer, the producer and the
        client that creates topics (``credentials_to_aiokafka_auth`` in
        ``faust/transport/drivers/aiokafka.py``)."""
        if self.protocol == "PLAINTEXT":
            return None
        import faust

        if self.protocol == "SSL":
            return faust.SSLCredentials(self.ssl_context)
        return faust.SASLCredentials(username=self.username, password=self.password,
                                     mechanism=self.mechanism, ssl_context=self.ssl_context)


def from_env(environ: Mapping[str, str] | None = None) -> KafkaSecurity:
    """``KafkaSecurity.from_env``: the settings in ``environ`` (default ``os.environ``)."""
    return KafkaSecurity.from_env(environ)


# --- ACLs -------------------------------------------------------------------------------------------
class Acl(NamedTuple):
    """One ALLOW rule: ``principal`` may do ``operation`` on a resource.

    resource_type: TOPIC | GROUP | CLUSTER; pattern: LITERAL | PREFIXED (Kafka's names)."""

    principal: str
    resource_type: str
    resource_name: str
    pattern: str
    operation: str

    def __str__(self) -> str:
        what = "cluster" if self.resource_type == "CLUSTER" else (
            f"{self.resource_type.lower()} {self.resource_name}{'*' if self.pattern == 'PREFIXED' else ''}")
        return f"{self.principal} {self.operation} {what}"


def switchyard_acls(topic_prefix: str = "", app_id: str = "switchyard", *, provider: str = "provider",
                    gateway: str = "gateway", operator: str = "operator", worker: str = "worker") -> list[Acl]:
    """The ALLOW rules each Switchyard principal needs (everything else is denied when the broker
    runs with ``allow.everyone.if.no.acl.found=false``). ``topic_prefix`` and ``app_id`` are the
    worker's ``SWITCHYARD_TOPIC_PREFIX`` and ``SWITCHYARD_APP_ID``; the principal arguments are
    SASL user names. See docs/security.md for the table and the reasons."""
    p = topic_prefix
    t = lambda user, name, op, pattern="LITERAL": Acl(f"User:{user}", "TOPIC", name, pattern, op)  # noqa: E731
    acls = [
        t(provider, f"{p}switchyard.providers", "WRITE"),
        t(gateway, f"{p}switchyard.requests", "WRITE"),
        t(gateway, f"{p}switchyard.completions", "WRITE"),
        t(gateway, f"{p}switchyard.decisions", "READ"),
        t(operator, f"{p}switchyard.config", "WRITE"),
    ]
    # The worker: every switchyard topic (inputs, journal, outputs, reply topics under the prefix)
    # and its changelog and assignor topics ("<app_id>-..."): READ, WRITE, and CREATE because Faust
    # sends CreateTopics for its internal topics at every start, existing or not (DESCRIBE is
    # implied by READ/WRITE). Its consumer group: READ. Measured minimal with faust-streaming
    # 0.15.3 and Kafka 4.0; processing_guarantee="exactly_once" would add IDEMPOTENT_WRITE on the
    # cluster and WRITE on transactional ids.
    for name in (f"{p}switchyard.", f"{app_id}-"):
        acls += [t(worker, name, op, "PREFIXED") for op in ("READ", "WRITE", "CREATE")]
    acls.append(Acl(f"User:{worker}", "GROUP", app_id, "LITERAL", "READ"))
    # To check at start that the journal is kept forever (streams/journal_topic.py); without it
    # the worker runs the same and logs that it could not check.
    acls.append(t(worker, f"{p}switchyard.journal", "DESCRIBE_CONFIGS"))
    return acls
