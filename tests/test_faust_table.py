"""streams/faust_table.py: the core table's keys are encoded as Faust's json codec encodes them,
and a write or delete reaches RocksDB and the changelog queue as Faust's own path would send it
(the shortcuts must not change a byte of what the store and the changelog hold)."""
from __future__ import annotations

import faust

from streams import faust_table
from streams.persistence import key

KEYS = ["meta", "ckpt", key("p", "p00001"), key("d", 10, 20), key("reply", "req-é", 0), 'quote"back\\slash',
        "\x00\x7f control", "emoji \U0001F600"]


def test_table_keys_values_and_changelog_as_faust_writes_them(tmp_path):
    app = faust.App("switchyard-keys", store=f"{faust_table.SCHEME}://", Table=faust_table.Table,
                    datadir=str(tmp_path))
    table = app.Table("core", default=None, partitions=1, key_type=str, value_type=bytes)
    for i, k in enumerate(KEYS):
        expected = app.serializers.dumps_key(str, k, serializer="json")
        assert table.data._encode_key(k) == expected
        assert table.data._decode_key(expected) == k
        value = b'{"o":%d}' % i
        table[k] = value
        assert table._changes[-1] == (expected, value)
        assert table.data._get(expected) == value and table[k] == value
    for k in KEYS[:3]:
        del table[k]
        assert table._changes[-1] == (app.serializers.dumps_key(str, k, serializer="json"), None)
        assert table.get(k) is None
    assert [table.get(k) for k in KEYS[3:]] == [b'{"o":%d}' % i for i in range(3, len(KEYS))]
