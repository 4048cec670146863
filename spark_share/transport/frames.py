"""The frame between our processes: a JSON header plus an optional binary blob (Arrow IPC for record data).

Owns: the frame's format, its bounds, and turning decrypted bytes back into frames. A connection cut in
a frame ends it (the lengths say a frame is short); a frame over the bounds ends it too.

Must never: unpickle anything (headers are JSON, blobs are handed to Arrow as they are).
"""
from __future__ import annotations

import json
import struct

from ..errors import ProtocolError
from .tls import Blob

FRAME = struct.Struct("!IQ")  # header length, blob length
MAX_HEADER = 64 << 20
MAX_BLOB = 4 << 30
CHUNK = 256 << 10  # plaintext encrypted at once, and bytes read from a socket at once


class FrameReader:
    """Turns plaintext into frames. TLS decrypts into one scratch buffer, from which the prefixes and
    headers of however many frames a record holds are parsed; once a blob starts, what follows is
    decrypted straight into the blob's own buffer, handed on as it is (a blob is megabytes)."""

    def __init__(self) -> None:
        self._scratch = bytearray(CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self._pending = bytearray()  # plaintext received and not yet parsed: the start of a frame
        self._header: dict = {}
        self._blob: bytearray | None = None
        self._blob_got = 0

    def want(self) -> memoryview:
        """Where the next plaintext goes."""
        if self._blob is not None:
            return memoryview(self._blob)[self._blob_got:]
        return self._scratch_view

    def filled(self, n: int) -> list[tuple[dict, Blob]]:
        """``n`` more bytes are in ``want()``'s view: the frames now complete."""
        if self._blob is not None:
            self._blob_got += n
            return [self._blob_done()] if self._blob_got == len(self._blob) else []
        self._pending += self._scratch_view[:n]
        frames = []
        at = 0
        pending = self._pending
        while len(pending) - at >= FRAME.size:
            hl, bl = FRAME.unpack_from(pending, at)
            if hl > MAX_HEADER or bl > MAX_BLOB or hl == 0:
                raise ProtocolError(f"oversized or empty frame ({hl} + {bl} bytes)")
            if len(pending) - at < FRAME.size + hl:
                break
            header = json.loads(pending[at + FRAME.size: at + FRAME.size + hl])
            if not isinstance(header, dict):
                raise ProtocolError("malformed frame header")
            at += FRAME.size + hl
            if not bl:
                frames.append((header, b""))
                continue
            self._header, self._blob = header, bytearray(bl)
            self._blob_got = min(bl, len(pending) - at)
            self._blob[:self._blob_got] = pending[at: at + self._blob_got]
            at += self._blob_got
            if self._blob_got < bl:
                break  # the rest is decrypted straight into it
            frames.append(self._blob_done())
        del pending[:at]
        return frames

    def _blob_done(self) -> tuple[dict, Blob]:
        assert self._blob is not None
        frame = (self._header, self._blob)
        self._blob, self._blob_got = None, 0
        return frame


def encode_frame(header: dict, blob: Blob) -> tuple[bytes, Blob]:
    h = json.dumps(header, separators=(",", ":")).encode()
    return FRAME.pack(len(h), len(blob)) + h, blob


def decode_frame(data: bytes) -> tuple[dict, bytes]:
    """One whole frame held in memory (a file of ``mailbox``'s), with the bounds a connection checks."""
    if len(data) < FRAME.size:
        raise ProtocolError("a truncated frame")
    hl, bl = FRAME.unpack_from(data)
    if hl > MAX_HEADER or bl > MAX_BLOB or hl == 0 or len(data) != FRAME.size + hl + bl:
        raise ProtocolError(f"a malformed frame ({hl} + {bl} bytes in {len(data)})")
    header = json.loads(data[FRAME.size:FRAME.size + hl])
    if not isinstance(header, dict):
        raise ProtocolError("malformed frame header")
    return header, data[FRAME.size + hl:]
