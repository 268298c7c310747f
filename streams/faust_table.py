"""Faust's table and RocksDB store for the core state, writable outside a stream event.

Faust picks the partition of a table write (its changelog message and its RocksDB database) from
the current stream event. The lease holder (streams/service.py) applies journal entries in its own
task, when the broker acknowledges them, so there is no event. This app's tables have one
partition, so every write goes to partition 0. A table with `value_type=bytes` stores and logs
its values unchanged. The store is registered as the scheme
`switchyard-rocksdb://`; the app uses both through its `Table` and `store` settings.
"""
from __future__ import annotations

from typing import Any, Optional

import faust
from faust.stores import STORES
from faust.stores.rocksdb import Store as RocksDBStore

SCHEME = "switchyard-rocksdb"


class Table(faust.Table):
    def partition_for_key(self, key: Any) -> Optional[int]:
        return 0

    def _serializer_from_type(self, typ):
        # Faust would read a bytes-valued table as JSON; its values are already encoded.
        return "raw" if typ is bytes else super()._serializer_from_type(typ)


class Store(RocksDBStore):
    def _set(self, key: bytes, value: Optional[bytes]) -> None:
        self._key_index[key] = 0
        self._db_for_partition(0).put(key, value)


STORES.aliases[SCHEME] = f"{__name__}:Store"
