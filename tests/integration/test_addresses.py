"""Where the driver side listens and what an executor is told when it cannot get there: the option
'trackerPort' (a port or a range, for firewalled clusters), IPv6 addresses, and the error of an
agent that cannot reach the tracker. No Spark: a tracker on the embedded broker."""
from __future__ import annotations

import socket

import pytest

from harness.support import gid, kafka_options, uid
from spark_share.consumers.agent import _connect_tracker
from spark_share.driver.tracker import Tracker
from spark_share.errors import OptionError, SourceError
from spark_share.options import parse_options
from spark_share.transport import endpoints


def _tracker(kafka, **options) -> Tracker:
    topic = kafka.create_topic(uid("addr"), 1)
    return Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()),
                                  "subscribe": topic, **options}))


def _free_port_pair() -> int:
    """A port P such that P and P+1 are free now (the test then holds P itself)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 65535:
            try:
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise AssertionError("no two free ports in a row")


def test_the_tracker_listens_on_the_first_free_port_of_the_range(kafka):
    first = _free_port_pair()
    taken = socket.socket()
    taken.bind(("127.0.0.1", first))
    taken.listen(1)
    t = _tracker(kafka, trackerPort=f"{first}-{first + 1}")
    try:
        assert t.address == ("127.0.0.1", first + 1)
        with pytest.raises(SourceError, match=rf"option 'trackerPort' = '{first}': no port of it is free on 127.0.0.1"):
            _tracker(kafka, trackerPort=str(first))
    finally:
        t.shutdown()
        taken.close()


def test_bad_port_options_name_the_option():
    base = {"kafka.bootstrap.servers": "b:9092", "kafka.group.id": "g", "subscribe": "t"}
    for bad in ("abc", "5-3", "70000", "0-10", "-1"):
        with pytest.raises(OptionError, match="option 'trackerPort'"):
            parse_options({**base, "trackerPort": bad})
    assert parse_options({**base, "trackerPort": "40100-40199"}).tracker_ports == (40100, 40199)
    assert parse_options(base).tracker_ports == (0, 0)


def test_an_ipv6_driver_address_works(kafka, monkeypatch):
    monkeypatch.setenv("SPARK_SHARE_BIND_HOST", "::1")
    t = _tracker(kafka)
    try:
        assert t.address[0] == "::1"
        conn = endpoints.connect(tuple(t.address), t.secret)  # what an agent does
        assert not conn.closed
        conn.close()
    finally:
        t.shutdown()


def test_an_executor_that_cannot_reach_the_tracker_is_told_the_address_and_the_option():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once the socket is closed
    with pytest.raises(ConnectionError) as e:
        _connect_tracker(("127.0.0.1", port), "s3cret-value")
    text = str(e.value)
    assert f"127.0.0.1:{port}" in text and "spark.driver.host" in text and "'trackerPort'" in text
    assert "s3cret-value" not in text
