"""The source's offset: ``{"v": 1, "batch": N}``, the id of the last planned batch and nothing else.

Owns: the offset format Spark writes to the checkpoint's offset log. Must never: carry an address,
a secret or Kafka offsets (a share group has no offsets to resume from; the broker tracks delivery).
"""
from __future__ import annotations

from .errors import SourceError

OFFSET_VERSION = 1
INITIAL = -1  # the offset before the first batch


def offset_of(batch: int) -> dict:
    return {"v": OFFSET_VERSION, "batch": batch}


def batch_of(offset: dict) -> int:
    """The batch id in an offset; a clear error for an offset another source or version wrote."""
    if not isinstance(offset, dict) or offset.get("v") != OFFSET_VERSION or "batch" not in offset:
        raise SourceError(f"unrecognised kafka-share offset {offset!r}: this checkpoint was written by another "
                         "source or version; start the query with a new checkpointLocation")
    return int(offset["batch"])
