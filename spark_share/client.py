"""The user's process talking to a query's tracker on this host: connections and ``status``.

Owns: finding a running query's tracker through the registry entry it wrote (address and per-query
secret, owner-only), one authenticated connection per query kept while the query runs, and
``status(query)``.

Must never: connect to anything but an address from this host's registry, or keep a connection
after its query terminated (the listener drops it).
"""
from __future__ import annotations

import threading

from . import runtime, wire
from .errors import VerdictError
from .protocol import Status, call

_conns: dict[str, wire.RpcConnection] = {}
_conns_lock = threading.Lock()


def tracker_for(query_id: str) -> wire.RpcConnection | None:
    """The authenticated connection to the tracker of a running kafka-share query on this host."""
    with _conns_lock:
        conn = _conns.get(query_id)
        if conn is not None and not conn.closed:
            return conn
        reg = runtime.registry_entry(query_id)
        if reg is None:
            return None
        try:
            conn = wire.connect((reg["host"], reg["port"]), reg["secret"], name="verdicts")
        except OSError:
            return None
        _conns[query_id] = conn
        return conn


def forget(query_id: str) -> None:
    """Close the connection to a query's tracker (the query terminated)."""
    with _conns_lock:
        conn = _conns.pop(query_id, None)
    if conn is not None:
        conn.close()


def status(query) -> dict:
    conn = tracker_for(str(query.id))
    if conn is None:
        raise VerdictError(f"query {query.id} is not a running kafka-share query on this host")
    rep, _ = call(conn, Status(), timeout=30)
    return rep
