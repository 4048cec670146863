"""The offset format: the batch id, the run that planned it and the source's exchangeLocation, and what a
progress report shows of it."""
import json

import pytest

from spark_share.errors import SourceError
from spark_share.offsets import batch_of, offset_of, reported


def test_an_offset_names_its_batch_and_run_only():
    assert offset_of(3, "abc") == {"v": 1, "batch": 3, "run": "abc"}
    # With exchangeLocation, that directory: the listener's way to the tracker's mailbox.
    assert offset_of(3, "abc", "/Volumes/x") == {"v": 1, "batch": 3, "run": "abc", "exchange": "/Volumes/x"}
    assert batch_of(offset_of(3, "abc")) == 3
    assert batch_of({"v": 1, "batch": 7}) == 7  # written before offsets named their run


def test_what_a_progress_report_shows_is_read_back():
    assert reported(json.dumps(offset_of(5, "abcd"))) == (5, "abcd", None)
    assert reported(json.dumps(offset_of(5, "abcd", "/Volumes/x"))) == (5, "abcd", "/Volumes/x")
    assert reported('{"v": 1, "batch": 5}') == (5, None, None)
    # Spark < 4.2's Connect listener events show str() of the parsed JSON.
    assert reported(str(offset_of(5, "abcd"))) == (5, "abcd", None)
    assert reported("__import__('os').system('true')") is None
    for other in (None, "", "not json", "[1]", '{"v": 2, "batch": 1}', '{"v": 1}', '{"v": 1, "batch": "x"}',
                  '{"v": 1, "batch": 1, "topic": "t"}', '{"logOffset": 12}'):
        assert reported(other) is None, other


def test_another_sources_offset_is_a_clear_error():
    with pytest.raises(SourceError, match="another source or version"):
        batch_of({"logOffset": 3})
