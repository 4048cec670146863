"""The source's offset: ``{"v": 1, "batch": N, "run": R}``, the id of the last planned batch and the
query run (its tracker) that planned it, plus ``"exchange"``, the source's ``exchangeLocation`` when it
has one, and under readMode=driver ``"records"``: the records the batch acquired (``record_ranges``), so
that Spark running the batch again gets them again, and a later run knows which records Spark committed;
and ``"pending"``, while there are any: records of batches committed before it that had not come back to
the run that planned it (an earlier run may not have acknowledged them), with since when.

Owns: the offset format Spark writes to the checkpoint's offset log and shows in every progress report.
The run lets the commit listener find the tracker of a batch from the progress alone, on every Spark
(Spark < 4.2 has no ``reportLatestOffset``, and under Spark Connect nothing else names the query's
tracker); the exchange location lets it reach that tracker's mailbox where it sees nothing else of it (a
source sandboxed apart from the user's process). Offsets of older versions, without them, are read as
they are. Must never: carry an address or a secret, or be read as a position to resume from (a share group has
none; the broker tracks delivery): the records it names are one batch's, to acquire again or to ACCEPT.
"""
from __future__ import annotations

import ast
import json

from .errors import SourceError
from .record_ranges import RecordRanges

OFFSET_VERSION = 1
INITIAL = -1  # the offset before the first batch


def offset_of(batch: int, run: str | None = None, exchange: str | None = None,
              records: RecordRanges | None = None, pending: tuple[float, RecordRanges] | None = None) -> dict:
    offset: dict = {"v": OFFSET_VERSION, "batch": batch}
    if run is not None:
        offset["run"] = run
    if exchange is not None:
        offset["exchange"] = exchange
    if records is not None:
        offset["records"] = records.encode()
    if pending is not None:
        offset["pending"] = {"since": round(pending[0], 3), "records": pending[1].encode()}
    return offset


def pending_of(offset: dict | None) -> tuple[float, RecordRanges] | None:
    """Records of batches Spark committed before this one that had not come back to the run that planned it
    (it may not have acknowledged them), and since when: (since, records), or None."""
    p = offset.get("pending") if isinstance(offset, dict) else None
    if not isinstance(p, dict) or "records" not in p:
        return None
    return float(p.get("since", 0.0)), RecordRanges.decode(p["records"])


def records_of(offset: dict | None) -> RecordRanges | None:
    """The records a batch's offset names; None for an offset without them (readMode=executors, an older
    version, the offset before the first batch)."""
    if not isinstance(offset, dict) or "records" not in offset:
        return None
    return RecordRanges.decode(offset["records"])


def batch_of(offset: dict) -> int:
    """The batch id in an offset; a clear error for an offset another source or version wrote."""
    if not isinstance(offset, dict) or offset.get("v") != OFFSET_VERSION or "batch" not in offset:
        raise SourceError(f"unrecognised kafka-share offset {offset!r}: this checkpoint was written by another "
                         "source or version; start the query with a new checkpointLocation")
    return int(offset["batch"])


def from_progress(text) -> object:
    """An offset (or the source's report) as a progress report carries it: JSON text, or on Spark < 4.2
    under Spark Connect the text of a Python dict (its listener events show ``str()`` of the parsed
    JSON). Literals only: never anything that could run code. None when it is neither."""
    if not isinstance(text, str) or len(text) > 100_000:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def reported(text: str | None) -> tuple[int, str | None, str | None] | None:
    """(batch id, run, exchange location) of an offset as a progress report shows it, None if it is not ours."""
    offset = from_progress(text)
    if not isinstance(offset, dict) or offset.get("v") != OFFSET_VERSION or not isinstance(offset.get("batch"), int):
        return None
    if not set(offset) <= {"v", "batch", "run", "exchange", "records", "pending"}:
        return None
    return offset["batch"], offset.get("run"), offset.get("exchange")
