"""A query's dead-letter target as the driver checks it when the query starts, and the file system of a
dead-letter path (the executor's writer, ``consumers/deadletter.py``, writes through it).

Owns: failing fast, naming the option, when the topic is missing or the path cannot be written, and
resolving a path (local, ``file://``, or any URI pyarrow knows) to its file system. Must never: write
a dead letter (the agents holding the records do), or leave its probe file behind.
"""
from __future__ import annotations

import os
import uuid

from .errors import DeadLetterError, SourceError


def check_target(opts, metadata_client) -> None:
    """Fail fast, naming the option, when the dead-letter target is missing or cannot be written."""
    if opts.dead_letter_topic:
        md = metadata_client.list_topics(opts.dead_letter_topic, timeout=30)
        t = md.topics.get(opts.dead_letter_topic)
        if t is None or t.error is not None:
            raise SourceError(f"option 'deadLetterTopic' = {opts.dead_letter_topic!r}: the topic does not exist on "
                              f"{opts.bootstrap_servers!r}; create it first (rejected records are written there)")
        # Whether this client may write there shows at the first reject: a refused write fails the
        # query, naming the option, and acknowledges nothing of its batch.
    if opts.dead_letter_path:
        check_path(opts.dead_letter_path)


def check_path(path: str) -> None:
    """Fail fast, naming the option, when the dead-letter path cannot be written."""
    fs, base = filesystem(path)
    probe = f"{base.rstrip('/')}/.spark-share-probe-{uuid.uuid4().hex[:8]}"
    try:
        fs.create_dir(base, recursive=True)
        with fs.open_output_stream(probe) as f:
            f.write(b"ok")
        fs.delete_file(probe)
    except Exception as e:
        raise DeadLetterError(f"option 'deadLetterPath' = {path!r} cannot be written ({type(e).__name__}: {e}); "
                              "give a directory this job can write, reachable from every executor") from None


def filesystem(path: str):
    from pyarrow import fs

    if "://" in path and not path.startswith("file://"):
        return fs.FileSystem.from_uri(path)
    local = path[len("file://"):] if path.startswith("file://") else path
    return fs.LocalFileSystem(), os.path.abspath(local)
