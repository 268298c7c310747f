"""Faust's table and RocksDB store for the core state, writable outside a stream event.

Faust picks the partition of a table write (its changelog message and its RocksDB database) from
the current stream event. The lease holder (streams/service.py) applies journal entries in its own
task, when the broker acknowledges them, so there is no event. This app's tables have one
partition, so every write goes to partition 0. A table with `value_type=bytes` stores and logs
its values unchanged. The store is registered as the scheme
`switchyard-rocksdb://`; the app uses both through its `Table` and `store` settings.

A write goes to RocksDB at once and its changelog message is queued until `send_changes`, which
produces the queue in order as a few aiokafka record batches. Faust would buffer each write as a
message for its producer's single sender task, one loop turn per message: at 1,000 requests/s
(~6,000 writes/s) that sender fell ~10 s behind, and its ~90,000 pending messages made each full
garbage collection stop the worker for 100-200 ms (docs/benchmarks.md).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any, Optional

import faust
import orjson
from faust.stores import STORES
from faust.stores.rocksdb import Store as RocksDBStore

SCHEME = "switchyard-rocksdb"


log = logging.getLogger(__name__)


class Table(faust.Table):
    _changes: list[tuple[bytes, Optional[bytes]]] | None = None  # changelog messages not yet sent

    def __setitem__(self, key: Any, value: Any) -> None:
        # The core table's writes (a str key, encoded bytes): straight to RocksDB and the changelog
        # queue, the key encoded once — what Faust's path does (`on_key_set`, then the store's
        # `__setitem__`) after two serializer lookups that pass the value through unchanged. A str
        # key's JSON is `orjson.dumps`: Faust's json codec is orjson behind a registry lookup.
        if type(key) is str and type(value) is bytes and self._raw_values():
            key_bytes = orjson.dumps(key)
            self.data._set(key_bytes, value)
            self._queue_raw(key_bytes, value)
        else:
            super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        if type(key) is str and self._raw_values():
            key_bytes = orjson.dumps(key)
            self.data._del(key_bytes)
            self._queue_raw(key_bytes, None)
        else:
            super().__delitem__(key)

    def _raw_values(self) -> bool:
        return self.key_serializer == "json" and self.value_serializer == "raw"

    def on_key_set(self, key: Any, value: Any) -> None:
        self._queue_change(key, self.changelog_topic.prepare_value(value, self.value_serializer)[0])

    def on_key_del(self, key: Any) -> None:
        self._queue_change(key, None)

    def _queue_change(self, key: Any, value: Optional[bytes]) -> None:
        self._queue_raw(self.changelog_topic.prepare_key(key, self.key_serializer)[0], value)

    def _queue_raw(self, key: bytes, value: Optional[bytes]) -> None:
        if self._changes is None:
            self._changes = []
        self._changes.append((key, value))

    async def send_changes(self) -> None:
        """Produce the changelog messages of the writes so far, in order (partition 0). A message
        leaves the queue once its batch is queued in the producer: cancelled before that (the
        worker stopping), it is sent by the next call."""
        producer = self.app.producer._producer  # Faust's aiokafka producer (started with the app)
        topic = self.changelog_topic.get_topic_name()
        while self._changes:
            batch, n = producer.create_batch(), 0
            for key, value in self._changes:
                if batch.append(key=key, value=value, timestamp=None) is None:  # full
                    break
                n += 1
            await self._send(producer, batch, topic)
            del self._changes[:n]

    async def _send(self, producer, batch, topic: str) -> None:
        sent = await producer.send_batch(batch, topic, partition=0)
        sent.add_done_callback(partial(self._on_batch_sent, batch.record_count() - 1))

    def _on_batch_sent(self, last: int, sent) -> None:
        # As Faust's own changelog callback: the store records the changelog offset it holds, so a
        # restart reads the changelog from there.
        error = "cancelled" if sent.cancelled() else sent.exception()
        if error is not None:
            log.error("changelog batch of %s not sent: %r", self.name, error)
            return
        meta = sent.result()
        self.data.set_persisted_offset(meta.topic_partition, meta.offset + last)

    def partition_for_key(self, key: Any) -> Optional[int]:
        return 0

    def _serializer_from_type(self, typ):
        # Faust would read a bytes-valued table as JSON; its values are already encoded.
        return "raw" if typ is bytes else super()._serializer_from_type(typ)


class Store(RocksDBStore):
    def _del(self, key: bytes) -> None:
        self._db_for_partition(0).delete(key)  # one partition (see `_set`)

    def _set(self, key: bytes, value: Optional[bytes]) -> None:
        # No key index: with one partition, Faust's index (an LRU cache behind a lock) only costs.
        self._db_for_partition(0).put(key, value)


STORES.aliases[SCHEME] = f"{__name__}:Store"
