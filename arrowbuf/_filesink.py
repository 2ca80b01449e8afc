"""One write lifecycle for every writer of arrowbuf files: start, write, commit, abort.

Parquet exports, checkpoints and Ray checkpoints all write through a `FileSink`
(the model is Ray Data's datasinks):

- **start** makes a fresh hidden pending directory on the target's file system;
- **write** is the caller's: it puts its files into ``sink.pending``;
- **commit** flushes every pending file and directory to disk (fsync), then
  publishes them with renames, the last of which makes the whole write visible at
  once, and flushes the directory that holds it;
- **abort** deletes the pending directory: the target is as it was.

Used as a context manager, a sink starts on entry and commits when the block ends
normally, or aborts when it raises. Two ways to publish:

- `DirectorySink`: the pending directory becomes the target directory (exports).
  A target that exists is swapped out in one atomic exchange (Linux
  ``renameat2(RENAME_EXCHANGE)``) and deleted after; where the exchange is not
  available it is renamed aside first (``.<name>.old-<id>``), so a crash between the
  two renames leaves the old copy complete there (`aside_copies` finds it).
- `ManifestSink`: pending files join the target directory under names no manifest
  lists yet, then the pending manifest replaces the target's (checkpoints, and the
  generations of Ray checkpoints). Readers follow the manifest only.

Example:
    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out"
    >>> with DirectorySink(target) as sink:
    ...     _ = (sink.pending / "data.txt").write_text("complete")
    >>> (target / "data.txt").read_text()
    'complete'
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path
from types import TracebackType

STAGING_PREFIX = ".tmp-"
_EXCHANGE = 2            # RENAME_EXCHANGE of renameat2(2)
_AT_FDCWD = -100


def fsync(path: Path) -> None:
    """Flush a file or directory to disk (a crash then cannot lose a write or a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``, ``root`` last."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync(Path(directory) / name)
        fsync(Path(directory))


def remove(path: Path) -> None:
    """Delete a file or a directory tree; a path that is gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def aside_copies(target: Path) -> list[Path]:
    """Copies of ``target`` that an interrupted `DirectorySink` replace renamed aside."""
    if not target.parent.is_dir():
        return []
    return sorted(target.parent.glob(f".{target.name}.old-*"))


class FileSink:
    """The lifecycle of one write of files into ``target``; subclasses say how to publish.

    Args:
        target: the directory the write is for.
        pending: where the files are written before the commit (fresh, hidden).
    """

    def __init__(self, target: Path, pending: Path) -> None:
        self.target = target
        self.pending = pending
        self.committed = False

    def start(self) -> None:
        """Create the pending directory (and the target's parents)."""
        self.pending.mkdir(parents=True)

    def commit(self) -> None:
        """Flush the staged files to disk and publish them (`publish`)."""
        fsync_tree(self.pending)
        self.publish()
        self.committed = True

    def abort(self) -> None:
        """Delete whatever was written; the target stays as it was."""
        remove(self.pending)

    def publish(self) -> None:
        """Make the pending files visible at ``target`` (the last step atomic)."""
        raise NotImplementedError

    def __enter__(self) -> "FileSink":
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


class DirectorySink(FileSink):
    """A directory written whole: the pending directory becomes ``target``.

    Args:
        target: the directory to create or replace (the caller decides whether an
            existing one may be replaced).
    """

    def __init__(self, target: Path) -> None:
        super().__init__(target, target.with_name(f".{target.name}{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"))

    def start(self) -> None:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        super().start()

    def publish(self) -> None:
        if not self.target.exists():
            self.pending.rename(self.target)
        elif _exchange(self.pending, self.target):
            pass    # the pending path now holds the old directory
        else:
            aside = self.target.with_name(f".{self.target.name}.old-{uuid.uuid4().hex[:12]}")
            self.target.rename(aside)
            try:
                self.pending.rename(self.target)
            except BaseException:
                aside.rename(self.target)
                raise
            self.pending = aside
        fsync(self.target.parent)
        remove(self.pending)


class ManifestSink(FileSink):
    """New files added to ``target``, committed by replacing its manifest.

    The pending files must have names the current manifest does not list; they are
    moved into ``target`` first, then the pending manifest replaces the old one in
    one rename. A crash before that rename leaves the old manifest, whose files
    are all still there.

    Args:
        target: the directory (created if needed).
        manifest: the manifest's file name; the caller writes it into ``pending``.
    """

    def __init__(self, target: Path, manifest: str) -> None:
        super().__init__(target, target / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}")
        self.manifest = manifest

    def publish(self) -> None:
        pending_manifest = self.pending / self.manifest
        if not pending_manifest.exists():
            raise FileNotFoundError(f"{pending_manifest}: the manifest was not written; nothing is committed")
        for entry in sorted(self.pending.iterdir()):
            if entry.name != self.manifest:
                os.replace(entry, self.target / entry.name)
        fsync(self.target)
        os.replace(pending_manifest, self.target / self.manifest)
        fsync(self.target)
        self.pending.rmdir()


def link_or_copy(source: Path, destination: Path) -> None:
    """Hard-link ``source`` to ``destination`` (a copy where links are not supported).

    Files arrowbuf publishes are never changed in place, so a link is as good as
    a copy, without the bytes.
    """
    try:
        os.link(source, destination)
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copy2(source, destination)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
