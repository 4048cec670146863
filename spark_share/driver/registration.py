"""How the user's code finds a query run's tracker: its registry entries, and its mailbox.

Owns: the run's entry (by tracker id, written once the tracker listens: foreachBatch under Spark
Connect and the listener on the server know only that id), the query's entry (by query id, written
when the first read or commit names the query), the refusal of a second kafka-share source in one
query, the run's mailbox under ``exchangeLocation`` when the user gave one (for user code that sees
neither this host's runtime directory nor its ports), and removing them all at the stop.

Must never: write an entry anywhere but the owner-only runtime directory (the secret is in it), or
let two trackers answer for one query id.
"""
from __future__ import annotations

import logging
import threading

from .. import runtime
from ..errors import SourceError
from ..transport.mailbox import MailboxServer

log = logging.getLogger("spark_share.driver.tracker")

TWO_SOURCES = ("this query reads two kafka-share sources; spark-share supports one per query: run a query per "
               "share group (or subscribe one source to several topics)")


class Registration:
    def __init__(self, tracker_id: str, entry: dict, exchange_location: str | None = None, handler=None,
                 scrub=lambda s: s):
        self.tracker_id = tracker_id
        self.entry = entry  # host, port, secret, tracker id, pid
        self.query_id: str | None = None
        self._lock = threading.Lock()  # the read tasks of the first batch name the query at the same time
        self._query_path: str | None = None
        self._run_path = runtime.run_registry_path(tracker_id)
        runtime.write_private_json(self._run_path, entry)
        self._mailbox = None
        if exchange_location is not None:
            try:
                self._mailbox = MailboxServer(exchange_location, tracker_id, handler, scrub)
            except OSError as e:
                runtime.remove(self._run_path)
                raise SourceError(f"option 'exchangeLocation' = {exchange_location!r}: cannot make this run's "
                                  f"directory there ({e}); give a directory the driver may write") from None

    def serve(self, query_id: str | None) -> bool:
        """Register ``query_id`` if no query is yet; True if this call did."""
        if not query_id or self.query_id is not None:
            return False
        with self._lock:
            if self.query_id is not None:
                return False
            other = runtime.live_registry_entry(query_id)
            if other and other.get("tracker_id") != self.tracker_id:
                # The user's process finds a query's tracker by the query id alone: a second kafka-share
                # source in the same query would take the first one's verdicts and commit signals.
                raise SourceError(TWO_SOURCES)
            self.query_id = query_id
            path = runtime.registry_path(query_id)
            runtime.write_private_json(path, self.entry)
            if (runtime.live_registry_entry(query_id) or {}).get("tracker_id") != self.tracker_id:  # lost a race
                raise SourceError(TWO_SOURCES)
            self._query_path = path
        log.info("spark-share tracker %s serves query %s", self.tracker_id, query_id)
        return True

    def remove(self) -> None:
        if self._mailbox is not None:
            self._mailbox.close()
        runtime.remove(self._query_path)
        runtime.remove(self._run_path)
