"""Spark's commit log of a query, as far as the driver side can read it.

Owns: finding a query's checkpoint (and its trigger) from the note the user's process writes when the
query starts (by the query's id, or, when no read task told the tracker its query (readMode=driver), by
the offsets this run wrote there), and answering whether Spark committed one of its batch ids, or the
batch that carries one of our offsets. A stop uses it: a batch Spark committed
a moment before (no signal reached the tracker yet) is ACCEPTed, not released.

Must never: write to the checkpoint, or guess: a commit log it cannot read (a remote store) answers
"not committed", and the batch is released (delivered again), never lost.
"""
from __future__ import annotations

import json
import logging
import os
import re

from .. import runtime

log = logging.getLogger("spark_share.driver.tracker")


def local_commit_dir(root: str) -> str | None:
    """The commit log directory of a checkpoint this process can read, or None (a remote store)."""
    if root.startswith("file:"):
        root = "/" + root[len("file:"):].lstrip("/")
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", root):
        return None
    return os.path.join(root, "commits")


OFFSETS_SEARCHED = 5  # the newest offset files a search by run reads: a stop's batches are the last ones


class CommitLog:
    def __init__(self, directory: str | None, trigger: str = "", root: str | None = None):
        self.directory = directory  # None: not readable from here
        self.root = root  # the checkpoint location as the query gave it
        self.trigger = trigger  # the query's trigger, as the JVM names its class ("" when not noted)

    @classmethod
    def of_query(cls, query_id: str) -> CommitLog | None:
        """The commit log of a query whose start the listener noted on this host, else None (not yet)."""
        found = cls._noted(query_id)
        if found is not None:
            log.info("query %s: commit log %s", query_id, found.directory
                     or f"not readable here ({found.root}): a stop releases batches nobody said were committed")
        return found

    @classmethod
    def _noted(cls, query_id: str) -> CommitLog | None:
        note = runtime.read_json(runtime.checkpoint_note_path(query_id))
        if not isinstance(note, dict) or not (note.get("root") or note.get("trigger")):
            return None
        root = note.get("root")
        return cls(local_commit_dir(str(root)) if root else None, str(note.get("trigger") or ""),
                   str(root) if root else None)

    @classmethod
    def of_run(cls, run: str) -> tuple[str, CommitLog] | None:
        """(query id, commit log) of the query whose checkpoint holds an offset of ``run`` among its newest,
        among the queries whose start was noted on this host; None if none does (yet)."""
        base = runtime.runtime_dir()
        for name in sorted(os.listdir(base)):
            if not (name.startswith("checkpoint-") and name.endswith(".json")):
                continue
            query_id = name[len("checkpoint-"):-len(".json")]
            found = cls._noted(query_id)
            if found is not None and found.spark_batch_of(run, None) is not None:
                return query_id, found
        return None

    def spark_batch_of(self, run: str, batch: int | None) -> int | None:
        """Spark's batch id whose offsets carry our offset of ``run`` (and ``batch``, unless None), among the
        newest OFFSETS_SEARCHED; None if none does or they cannot be read here."""
        if not self.directory:
            return None
        offsets = os.path.join(os.path.dirname(self.directory), "offsets")
        try:
            ids = sorted((int(n) for n in os.listdir(offsets) if n.isdigit()), reverse=True)[:OFFSETS_SEARCHED]
        except OSError:
            return None
        for spark_batch in ids:
            try:
                with open(os.path.join(offsets, str(spark_batch))) as f:
                    lines = f.read().splitlines()[2:]  # the version, then the batch's metadata
            except OSError:
                continue
            for line in lines:
                try:
                    offset = json.loads(line)
                except ValueError:
                    continue
                if isinstance(offset, dict) and offset.get("run") == run and batch in (None, offset.get("batch")):
                    return spark_batch
        return None

    def has(self, spark_batch: int | None) -> bool:
        """Did Spark commit its batch ``spark_batch``?"""
        return bool(self.directory and spark_batch is not None
                    and os.path.exists(os.path.join(self.directory, str(spark_batch))))
