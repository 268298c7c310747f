"""The journal topic's settings check (streams/journal_topic.py), on DescribeConfigs-shaped input."""
from streams.journal_topic import JOURNAL_CONFIG, journal_config_problem


def test_the_settings_the_worker_creates_the_journal_with_are_fine():
    assert journal_config_problem(dict(JOURNAL_CONFIG)) is None
    assert journal_config_problem({"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete",
                                   "segment.bytes": "1073741824"}) is None


def test_a_broker_default_retention_is_reported_with_the_fix():
    problem = journal_config_problem({"retention.ms": "604800000", "retention.bytes": "-1", "cleanup.policy": "delete"})
    assert problem.startswith("retention.ms=604800000 (")
    assert "retention.bytes" not in problem.split(".")[0]
    assert "--add-config retention.ms=-1,retention.bytes=-1,cleanup.policy=delete" in problem


def test_a_size_limit_and_compaction_are_reported_too():
    problem = journal_config_problem({"retention.ms": "-1", "retention.bytes": "0", "cleanup.policy": "compact,delete"})
    assert "cleanup.policy=compact,delete" in problem and "retention.bytes=0" in problem
    assert "retention.ms=" not in problem.split("Fix:")[0]


def test_missing_or_null_values_are_not_reported():
    assert journal_config_problem({}) is None
    assert journal_config_problem({"retention.ms": None, "cleanup.policy": None}) is None
