"""streams/faust_table.py: the core table's keys are encoded as Faust's json codec encodes them
(the shortcut must not change a byte of what RocksDB and the changelog hold)."""
from __future__ import annotations

import faust

from streams import faust_table
from streams.persistence import key

KEYS = ["meta", "ckpt", key("p", "p00001"), key("d", 10, 20), key("reply", "req-é", 0), 'quote"back\\slash',
        "\x00\x7f control", "emoji \U0001F600"]


def test_table_keys_are_faust_json(tmp_path):
    app = faust.App("switchyard-keys", store=f"{faust_table.SCHEME}://", Table=faust_table.Table,
                    datadir=str(tmp_path))
    table = app.Table("core", default=None, partitions=1, key_type=str, value_type=bytes)
    for k in KEYS:
        expected = app.serializers.dumps_key(str, k, serializer="json")
        assert table.data._encode_key(k) == expected
        table._queue_change(k, b"v")
        assert table._changes[-1] == (expected, b"v")
        assert table.data._decode_key(expected) == k
