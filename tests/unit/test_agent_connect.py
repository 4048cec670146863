"""An agent reaching its tracker: a cut network is waited out in short attempts, a refusal fails at once,
and the error names what to fix."""
from __future__ import annotations

import errno

import pytest

from spark_share.consumers import agent
from spark_share.errors import PeerConnectionError


def test_a_cut_network_is_waited_out_in_short_attempts_and_a_refusal_fails_at_once(monkeypatch):
    tried = []

    def connect(address, secret, timeout=None, **kw):
        tried.append(timeout)
        if len(tried) == 1:
            raise TimeoutError("timed out")  # SYNs dropped
        if len(tried) == 2:
            raise OSError(errno.ENETUNREACH, "Network is unreachable")  # the host's link down
        return "connected"
    monkeypatch.setattr(agent.endpoints, "connect", connect)
    monkeypatch.setattr(agent.time, "sleep", lambda s: None)
    assert agent._connect_tracker(("10.0.0.5", 40100), "secret") == "connected"
    assert tried == [agent.CONNECT_ATTEMPT_S] * 3

    def refused(address, secret, timeout=None, **kw):
        tried.append(timeout)
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    tried.clear()
    monkeypatch.setattr(agent.endpoints, "connect", refused)
    with pytest.raises(PeerConnectionError, match=r"cannot reach the spark-share tracker on the driver at "
                                                   r"10\.0\.0\.5:40100 .*set spark\.driver\.host"):
        agent._connect_tracker(("10.0.0.5", 40100), "secret")
    assert len(tried) == 1


def test_waiting_for_a_cut_network_is_bounded(monkeypatch):
    clock = [0.0]

    def connect(address, secret, timeout=None, **kw):
        clock[0] += timeout
        raise TimeoutError("timed out")
    monkeypatch.setattr(agent.endpoints, "connect", connect)
    monkeypatch.setattr(agent.time, "monotonic", lambda: clock[0])
    with pytest.raises(PeerConnectionError, match="TimeoutError"):
        agent._connect_tracker(("10.0.0.5", 40100), "secret")
    assert agent.CONNECT_WAIT_S <= clock[0] <= agent.CONNECT_WAIT_S + agent.CONNECT_ATTEMPT_S
