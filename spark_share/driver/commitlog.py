"""Spark's commit log of a query, as far as the driver side can read it.

Owns: finding a query's checkpoint (and its trigger) from the note the user's process writes when the
query starts, and answering whether Spark committed one of its batch ids. A stop uses it: a batch Spark committed
a moment before (no signal reached the tracker yet) is ACCEPTed, not released.

Must never: write to the checkpoint, or guess: a commit log it cannot read (a remote store) answers
"not committed", and the batch is released (delivered again), never lost.
"""
from __future__ import annotations

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


class CommitLog:
    def __init__(self, directory: str | None, trigger: str = ""):
        self.directory = directory  # None: not readable from here
        self.trigger = trigger  # the query's trigger, as the JVM names its class ("" when not noted)

    @classmethod
    def of_query(cls, query_id: str) -> CommitLog | None:
        """The commit log of a query whose start the listener noted on this host, else None (not yet)."""
        note = runtime.read_json(runtime.checkpoint_note_path(query_id))
        if not isinstance(note, dict) or not (note.get("root") or note.get("trigger")):
            return None
        root = note.get("root")
        directory = local_commit_dir(str(root)) if root else None
        log.info("query %s: commit log %s", query_id,
                 directory or f"not readable here ({root}): a stop releases batches nobody said were committed")
        return cls(directory, str(note.get("trigger") or ""))

    def has(self, spark_batch: int | None) -> bool:
        """Did Spark commit its batch ``spark_batch``?"""
        return bool(self.directory and spark_batch is not None
                    and os.path.exists(os.path.join(self.directory, str(spark_batch))))
