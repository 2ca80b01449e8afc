"""Private durable directories: an exclusive lock held by the one process that writes one,
and owner-only permissions on what is in it.

`DirectoryLock` takes ``fcntl.flock(LOCK_EX)`` on ``<directory>/lock``. The lock
belongs to the open file, so the OS releases it when the holder's process ends,
however it ends (a SIGKILLed driver or shard actor leaves nothing to clean up);
the file stays, and records who holds it (pid, host, since) for the error a second
opener gets. ``flock`` locks are per open file, not per process: a second open in
the same process is refused as well.

Durable data is readable by its owner only: directories 0700, files 0600
(`private_directory`, `private_tree`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from arrowbuf.errors import InUseError

LOCK_NAME = "lock"
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


def private_directory(directory: Path, tighten: bool = True) -> Path:
    """Create ``directory`` (and missing parents) readable by its owner only; with ``tighten``,
    make it so if it exists (False for a directory the user chose, which may be shared)."""
    existed = directory.is_dir()
    directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    if (tighten or not existed) and directory.stat().st_mode & 0o777 != DIRECTORY_MODE:
        os.chmod(directory, DIRECTORY_MODE)
    return directory


def private_tree(root: Path) -> None:
    """Make every directory under ``root`` 0700 and every file 0600 (after a checkpoint's save)."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, DIRECTORY_MODE)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


def holder_of(directory: Path) -> str:
    """Who holds ``directory``'s lock, as its lock file says (best effort)."""
    try:
        info = json.loads((directory / LOCK_NAME).read_text())
        note = f", {info['note']}" if info.get("note") else ""
        return f"process {info['pid']} on host {info['host']!r} (since {info['since']}{note})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file names none)"


class DirectoryLock:
    """An exclusive lock on ``directory`` (created 0700 if missing) for this process.

    Args:
        directory: the durable directory.
        wait: seconds to keep trying while another process holds it (a restarted
            shard waits for its killed predecessor's process to be gone).
        note: what else names the holder in the lock file (a store's shard, its driver).

    Raises:
        InUseError: another process holds the lock (the message names it).
    """

    def __init__(self, directory: str | os.PathLike, wait: float = 0.0, note: str | None = None) -> None:
        self.directory = private_directory(Path(directory))
        path = self.directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        self._file = os.fdopen(fd, "r+b", buffering=0)   # closed (and the lock released) when collected too
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self._file.close()
                    raise InUseError(
                        f"durable directory {self.directory} is in use by {holder_of(self.directory)}: one store "
                        "writes a durable directory at a time (two would lose each other's episodes). Close that "
                        "store or end its process (the lock goes with it), or pass another name= or durable= "
                        "directory") from None
                time.sleep(0.05)
        os.fchmod(fd, FILE_MODE)
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since,
                             "note": note}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)

    @property
    def held(self) -> bool:
        return not self._file.closed

    def release(self) -> None:
        """Give the lock up (closing the file releases it)."""
        self._file.close()
