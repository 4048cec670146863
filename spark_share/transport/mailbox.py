"""Requests from the user's code to a tracker through files: for platforms that isolate the user's code
from the source's process (no shared port, no shared runtime directory) but let both see one directory,
the source option ``exchangeLocation`` (a Unity Catalog volume, a mounted file system).

Owns: a tracker's mailbox, ``<location>/<tracker id>/`` (``requests/`` the user's code writes into,
``replies/`` the tracker answers in, ``alive`` rewritten with the time while it runs), the thread that answers its
requests with a ``wire`` handler, and the user's side: the live mailboxes of a location, and a call
through one that behaves as ``RpcConnection.call`` (a reply, or the peer's error raised as itself).

Must never: unpickle (a request is a ``frames`` frame: a JSON header and an Arrow blob), answer a request
twice, or leave its directory behind once the tracker stops. The files are as private as the location:
the mailbox is created owner-only, and nothing that travels through it is a secret (there is no socket,
so no per-query secret to check; the file system's permissions decide who may write).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import PeerConnectionError, from_wire, wire_name
from .frames import decode_frame, encode_frame

log = logging.getLogger("spark_share.transport.mailbox")

POLL_S = 0.05  # how often a tracker looks for requests, and a caller for its reply
ALIVE_EVERY_S = 2.0  # how often a running tracker rewrites ``alive``
STALE_AFTER_S = 30.0  # a mailbox whose ``alive`` is older than this belongs to a tracker that is gone
TRACKER_ID = re.compile(r"[0-9a-f]{16}")  # how driver.tracker names its mailbox
PRUNE_AFTER_S = 86_400.0  # a stale mailbox is removed by the next tracker that starts a day later
REQUEST, REPLY = ".req", ".rep"


def _write_atomically(path: str, header: dict, blob: bytes = b"") -> None:
    """Readers see the whole frame or no file: written under a temporary name, then renamed."""
    head, body = encode_frame(header, blob)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(head)
        f.write(body)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _prune(location: str) -> None:
    """Remove the mailboxes of trackers that ended without closing theirs (a killed process), a day on."""
    for name in os.listdir(location):
        directory = os.path.join(location, name)
        age = _age_s(directory)
        if age is not None and age > PRUNE_AFTER_S and os.path.isdir(os.path.join(directory, "requests")):
            shutil.rmtree(directory, ignore_errors=True)


def _age_s(directory: str) -> float | None:
    """Seconds since the tracker of a mailbox said it was alive; None if it is not a mailbox."""
    try:
        with open(os.path.join(directory, "alive")) as f:
            return time.time() - float(f.read())
    except (OSError, ValueError):
        return None


def _read_frame(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        return decode_frame(f.read())


class MailboxServer:
    """A tracker's mailbox: ``handler(conn, header, blob)`` (a ``protocol.dispatcher``) answers each request,
    on one thread, in the order they came."""

    def __init__(self, location: str, tracker_id: str, handler: Callable, scrub: Callable[[str], str] = lambda s: s):
        self.directory = os.path.join(location, tracker_id)
        self.name = f"mailbox {tracker_id}"
        self._handler = handler
        self._scrub = scrub
        self._stop = threading.Event()
        os.makedirs(location, exist_ok=True)
        _prune(location)
        os.mkdir(self.directory, 0o700)
        for sub in ("requests", "replies"):
            os.mkdir(os.path.join(self.directory, sub), 0o700)
        self._touch()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _touch(self) -> None:
        # The time as this host tells it, rather than the file's mtime, which a network file system's server sets.
        alive = os.path.join(self.directory, "alive")
        with open(alive + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(alive + ".tmp", alive)  # a reader never sees it empty

    def _run(self) -> None:
        touched = time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                if time.monotonic() - touched > ALIVE_EVERY_S:
                    touched = time.monotonic()
                    self._touch()
                names = sorted(n for n in os.listdir(os.path.join(self.directory, "requests")) if n.endswith(REQUEST))
            except OSError as e:  # the location went away for a moment (a network file system): the next poll sees
                log.debug("%s: %s", self.name, e)
                continue
            for name in names:
                self._answer(name)

    def _answer(self, name: str) -> None:
        path = os.path.join(self.directory, "requests", name)
        try:
            header, blob = _read_frame(path)
            os.unlink(path)  # once read it is ours alone: never answered twice
        except OSError:
            return
        except Exception as e:  # a malformed request: its sender gets the error
            _remove(path)
            header, blob = {}, b""
            rep = self.error_reply(None, e)
        else:
            try:
                out = self._handler(self, header, blob)
                rep = dict((out.result() if isinstance(out, Future) else out)[0] or {})
            except Exception as e:
                rep = self.error_reply(header.get("op"), e)
        try:
            _write_atomically(os.path.join(self.directory, "replies", name[:-len(REQUEST)] + REPLY), rep)
        except OSError as e:
            log.warning("%s: could not answer %s: %s", self.name, name, e)

    def error_reply(self, op, e: BaseException) -> dict:
        """As ``RpcConnection.error_reply``: the message scrubbed, our own error kinds by name."""
        log.debug("%s: handler failed for %s", self.name, op, exc_info=e)
        name = wire_name(e)
        return {"_error": self._scrub(str(e)), "_type": name} if name else \
            {"_error": self._scrub(f"{type(e).__name__}: {e}")}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(10)
        shutil.rmtree(self.directory, ignore_errors=True)


class MailboxConnection:
    """The user's side of one tracker's mailbox, with ``RpcConnection``'s ``call``."""

    closed = False

    def __init__(self, directory: str):
        self.directory = directory

    def call(self, header: dict, blob: bytes = b"", timeout: float | None = None) -> tuple[dict, bytes]:
        rid = uuid.uuid4().hex
        try:
            _write_atomically(os.path.join(self.directory, "requests", rid + REQUEST), header, blob)
        except OSError as e:
            raise PeerConnectionError(f"the tracker of {self.directory} stopped before it answered ({e})") from None
        reply = os.path.join(self.directory, "replies", rid + REPLY)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not os.path.exists(reply):
            if not os.path.isdir(self.directory):
                raise PeerConnectionError(f"the tracker of {self.directory} stopped before it answered")
            if deadline is not None and time.monotonic() > deadline:
                raise PeerConnectionError(f"the tracker of {self.directory} did not answer within {timeout:.0f} s")
            time.sleep(POLL_S)  # a file system has nothing to wait on: the reply is polled for
        rep, rblob = _read_frame(reply)
        os.unlink(reply)
        if "_error" in rep:
            raise from_wire(rep.get("_type", ""), rep["_error"])
        return rep, rblob

    def close(self) -> None:
        pass


def live_mailboxes(location: str) -> list[MailboxConnection]:
    """The mailboxes under ``location`` whose tracker is running (said so in ``alive`` lately)."""
    try:
        names = os.listdir(location)
    except OSError:
        return []
    return [box for box in (_live(os.path.join(location, name)) for name in sorted(names)) if box is not None]


def live_mailbox(location: str, tracker_id: str) -> MailboxConnection | None:
    """The mailbox of one tracker under ``location``, if it is running. The id comes from a progress report:
    anything but a tracker's id (16 hex digits) names no directory."""
    return _live(os.path.join(location, tracker_id)) if TRACKER_ID.fullmatch(tracker_id) else None


def _live(directory: str) -> MailboxConnection | None:
    age = _age_s(directory)
    return MailboxConnection(directory) if age is not None and age < STALE_AFTER_S else None
