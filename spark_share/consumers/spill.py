"""An agent's memory bound: the Arrow data of the batches it caches (acquired, not yet acknowledged) is
kept in memory up to a byte budget; past it, a batch's data goes to a file in the executor's Spark local
dir and is read back from there, memory-mapped.

Owns: the budget's count of bytes in memory, and moving a cached slot's data (its Arrow IPC and, with a
dead-letter target, every record it acquired) to a mapped file.

Must never: leave a file behind (each is unlinked once mapped: the mapping keeps the data until the slot
is acknowledged, and a killed agent leaves nothing on disk), or change a byte of what read tasks get.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any

import pyarrow as pa

log = logging.getLogger("spark_share.consumers.spill")
DEFAULT_BYTES = 256 << 20  # an agent's cached batches in memory, unless agentCacheBytes says otherwise


class SpillBudget:
    """How many bytes of cached slots an agent holds in memory (``admit`` and ``release`` keep the count),
    and the files the rest go to."""

    def __init__(self, limit: int, directory: str):
        self.limit = limit
        self.directory = directory
        self.in_memory = 0  # bytes of cached slots held in memory
        self.spilled = 0  # slots moved to a file, since the agent started
        self.spilled_bytes = 0
        self._lock = threading.Lock()

    def admit(self, entry: Any) -> None:
        """Count ``entry`` (an ``agent_acks.Cached``) in memory, or move its data to a mapped file if it
        does not fit in what the budget has left (or keep it, over budget, where no file can be written)."""
        size = _nbytes(entry.ipc) + _nbytes(entry.full)
        with self._lock:
            fits = self.in_memory + size <= self.limit
            if fits:
                self.in_memory += size  # reserved at once: reads that finish together share the budget
        if not fits:
            try:
                entry.ipc, entry.full = self._to_files(entry.ipc, entry.full)
            except OSError as e:  # a full or vanished local dir: over budget beats failing the read
                log.warning("cannot keep a batch of %d bytes in %s (%s); it stays in memory", size, self.directory, e)
            else:
                with self._lock:
                    self.spilled += 1
                    self.spilled_bytes += size
                return
            with self._lock:
                self.in_memory += size
        entry.in_memory = size

    def release(self, entry: Any) -> None:
        """``entry`` left the cache (acknowledged): its bytes in memory are free."""
        with self._lock:
            self.in_memory -= entry.in_memory
        entry.in_memory = 0

    def _to_files(self, ipc: pa.Buffer, full: pa.RecordBatch | None) -> tuple[pa.Buffer, pa.RecordBatch | None]:
        mapped = self._mapped(lambda f: f.write(ipc))
        if full is not None:
            full = pa.ipc.open_stream(self._mapped(lambda f: _write_stream(f, full))).read_next_batch()
        return mapped, full

    def _mapped(self, write) -> pa.Buffer:
        fd, path = tempfile.mkstemp(prefix="agent-cached-", suffix=".arrow", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            with pa.memory_map(path) as m:
                return m.read_buffer()  # the mapping outlives the file's name and the MemoryMappedFile
        finally:
            os.unlink(path)


def _nbytes(data: Any) -> int:
    if data is None:
        return 0
    return data.size if isinstance(data, pa.Buffer) else data.nbytes


def _write_stream(f, batch: pa.RecordBatch) -> None:
    with pa.ipc.new_stream(f, batch.schema) as w:
        w.write_batch(batch)
