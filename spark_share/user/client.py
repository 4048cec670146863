"""The user's process talking to a query's tracker on this host: connections and ``status``.

Owns: finding a running query's tracker through the registry entry it wrote (address and per-query
secret, owner-only) by query id or by tracker id, or through its mailbox under the source's
``exchangeLocation``; one authenticated connection per tracker kept while its query runs; and
``status(query)`` (from the query's progress when the tracker is out of this process's view: on
another host, or in a sandbox of its own).

Must never: connect to anything but an address from this host's registry, or keep a connection
after its query terminated (the listener drops it).
"""
from __future__ import annotations

import threading
import time

from .. import connect, offsets, runtime, spark_versions
from ..errors import PeerConnectionError, VerdictError
from ..transport import endpoints, mailbox, wire
from ..transport.protocol import Status, call

_conns: dict[str, wire.RpcConnection] = {}  # tracker id -> connection
_queries: dict[str, str] = {}  # query id -> tracker id
_conns_lock = threading.Lock()
FINAL_WAIT_S = 30.0  # how long status() of an ended query waits for its stopping tracker's final counts


def _connect(entry: dict | None) -> wire.RpcConnection | None:
    """The open connection to the tracker of a registry entry (call with ``_conns_lock`` held)."""
    if entry is None:
        return None
    tid = entry.get("tracker_id", "")
    conn = _conns.get(tid)
    if conn is not None and not conn.closed:
        return conn
    try:
        conn = endpoints.connect((entry["host"], entry["port"]), entry["secret"], name="verdicts")
    except (OSError, KeyError):
        return None
    _conns[tid] = conn
    return conn


def tracker_for(query_id: str) -> wire.RpcConnection | None:
    """The authenticated connection to the tracker of a running kafka-share query on this host."""
    with _conns_lock:
        entry = runtime.registry_entry(query_id)
        conn = _connect(entry)
        if conn is not None:
            _queries[query_id] = entry["tracker_id"]  # type: ignore[index]
        return conn


def tracker_by_id(tracker_id: str, query_id: str | None = None) -> wire.RpcConnection | None:
    """The connection to a tracker that runs on this host, by its id (None if it does not);
    ``forget(query_id)`` closes it."""
    with _conns_lock:
        conn = _connect(runtime.live_run_entry(tracker_id))
        if conn is not None and query_id:
            _queries[query_id] = tracker_id
        return conn


def mailbox_of(query) -> mailbox.MailboxConnection | None:
    """The mailbox of the tracker that planned the query's last batch, when its source has an exchangeLocation
    (its offset names both): the way to a tracker whose registry and ports this process cannot see."""
    last = query.lastProgress if query is not None else None
    for _, run, exchange in filter(None, (offsets.reported(s.endOffset) for s in (last.sources if last else []))):
        if run and exchange:
            return mailbox.live_mailbox(exchange, run)
    return None


def trackers_reachable(exchange_location: str | None = None) -> list:
    """Connections to every tracker running on this host, then the mailboxes of those running under
    ``exchange_location`` (the source's option, for trackers this process cannot see otherwise)."""
    with _conns_lock:
        found = [c for c in (_connect(e) for e in runtime.live_run_entries()) if c is not None]
    return found + (mailbox.live_mailboxes(exchange_location) if exchange_location else [])


def forget(query_id: str) -> None:
    """Close the connection to a query's tracker (the query terminated)."""
    with _conns_lock:
        conn = _conns.pop(_queries.pop(query_id, ""), None)
    if conn is not None:
        conn.close()


def status(query) -> dict:
    if connect.is_connect(query):
        return _status_from_progress(query)
    query_id = str(query.id)
    conn = tracker_for(query_id) if query.isActive else None
    if conn is not None:
        try:
            rep, _ = call(conn, Status(), timeout=30)
            return rep
        except PeerConnectionError:  # its run is stopping
            forget(query_id)
    # An ended run: the counts its tracker left as it stopped (it writes them before its registry entry goes).
    deadline = time.monotonic() + FINAL_WAIT_S
    while True:
        final = runtime.read_json(runtime.final_counts_path(query_id))
        if final is not None and not query.isActive:
            return final
        if runtime.registry_entry(query_id) is None:
            # No tracker of this host's runtime directory ever served it: its tracker is out of this
            # process's view (a sandbox of its own, another host); the query's progress still says.
            return _status_from_progress(query)
        if time.monotonic() > deadline:
            raise VerdictError(f"query {query_id} is not a kafka-share query of this host (running or ended here)")
        time.sleep(0.05)  # the run is stopping: its tracker writes the counts within its bounded stop


def kafka_share_progress(progress) -> dict | None:
    """Our part of a ``StreamingQueryProgress``: the source's ``latestOffset``, which is what the
    tracker reported when Spark planned the batch (its id, counts and lock headroom)."""
    for source in getattr(progress, "sources", None) or []:
        reported = offsets.from_progress(source.latestOffset)
        if isinstance(reported, dict) and "tracker" in reported:
            return reported
    return None


def _status_from_progress(query) -> dict:
    """Where the tracker is out of this process's view (a Spark Connect client, a sandbox): the tracker's full
    status when it runs on this host after all (a Connect server in this process), else the counts of the
    query's last progress (as of that batch's planning)."""
    last = query.lastProgress
    ends = [r for r in (offsets.reported(s.endOffset) for s in (last.sources if last else [])) if r is not None]
    conn = tracker_by_id(ends[0][1]) if ends and ends[0][1] else tracker_for(str(query.id))
    if conn is not None:
        rep, _ = call(conn, Status(), timeout=30)
        return rep
    counts = kafka_share_progress(last)
    if counts is not None:
        return dict(counts, view="lastProgress", sparkBatch=last.batchId, timestamp=last.timestamp)
    if ends:
        raise VerdictError(f"query {query.id}: its tracker runs out of this process's view (on the Spark Connect "
                           "server's host, or in a sandbox of its own), and this "
                           f"Spark ({spark_versions.VERSION_TEXT}) reports no source counters in the progress "
                           "(Spark >= 4.2 does): call status() where the tracker runs, or run 'spark-share status' there")
    raise VerdictError(f"query {query.id} has reported no kafka-share progress yet (it has not planned a batch, "
                       "or it does not read format('kafka-share')); try again after its first batch")
