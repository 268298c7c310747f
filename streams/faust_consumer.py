"""The aiokafka consumer Faust's worker uses, with two fixes, installed by `install(rewind)`.

1. Faust hard-codes aiokafka's fetch_max_wait_ms=1500: a fetch in flight while a partition is
   paused for flow control can hold new entries of that partition back for up to 1.5 s. A gateway
   waits on every journal entry, so the worker asks with a short wait instead.
2. aiokafka's `seek_to_committed` leaves partitions that were never committed where they are.
   Faust drops records it fetched when a rebalance interrupts a batch and relies on that seek to
   fetch them again; so a standby that took over an input partition before the dead worker's first
   commit lost them (a takeover that then decided nothing, docs/reliability.md). Never-committed
   partitions that `rewind(tp)` selects are sought to their beginning, as auto_offset_reset=earliest
   would have placed them.
"""
from __future__ import annotations

import types
from typing import Callable

import aiokafka
import faust.transport.drivers.aiokafka as faust_aiokafka_driver

FETCH_MAX_WAIT_MS = 100


class SwitchyardConsumer(aiokafka.AIOKafkaConsumer):
    rewind: Callable[[aiokafka.TopicPartition], bool] = staticmethod(lambda tp: False)

    def __init__(self, *args, **kwargs):
        kwargs["fetch_max_wait_ms"] = FETCH_MAX_WAIT_MS
        super().__init__(*args, **kwargs)

    async def seek_to_committed(self, *partitions):
        committed = await super().seek_to_committed(*partitions)
        never = [tp for tp, offset in committed.items() if not offset and self.rewind(tp)]  # None or 0
        if never:
            await self.seek_to_beginning(*never)
        return committed


def install(rewind: Callable[[aiokafka.TopicPartition], bool]) -> None:
    """Make Faust's aiokafka driver build SwitchyardConsumer; `rewind` picks the stream partitions
    (not the tables' changelogs, which Faust's recovery positions itself)."""
    SwitchyardConsumer.rewind = staticmethod(rewind)
    patched = types.ModuleType("aiokafka")
    patched.__dict__.update(aiokafka.__dict__)
    patched.AIOKafkaConsumer = SwitchyardConsumer
    faust_aiokafka_driver.aiokafka = patched
