"""The append-only episode log of one engine: appends flushed before they return, replay, compaction.

A durable shard (`arrowbuf.durable`) logs every episode its engine stores, in
segments of records (`arrowbuf._log_records`), and flushes each append to disk
(``fdatasync``) before the write is acknowledged.

**Exactly once.** Episode ids follow from the order of writes (``shard + k *
num_shards`` for the k-th episode a shard stores), so the log records each
episode with its id and `EpisodeLog.replay` re-adds exactly the logged episodes
whose id the engine has not reached: those of the checkpoint are skipped, and the
others get their logged ids again. A retried write (the shard died after logging
it, before its answer arrived) carries the batch number its writer gave it, and
`EpisodeLog.seen` recognises it.

**Crashes and damage.** A record is appended and flushed before the answer, and
nothing is written after it until then, so a crash can only leave a torn last record
(its bytes run past the end of the newest segment): it was never acknowledged, and
opening the log drops it. The two are told apart by ordering: once an append's bytes
are flushed, and before it returns, the head file (``log-head``) is moved past them,
so the head never claims more than the segment holds, and a newest segment that ends
before the head's acknowledged end (cut, emptied), or is missing (deleted), was
damaged. Each segment's start record names its predecessor and the bytes it ended
with, so an older segment cut at a record boundary is found too. Any damage (a bad
header or checksum, a cut, emptied or deleted segment, the head deleted, ids that
skip) raises `FormatError` naming the file and what it cannot vouch for. The head
moves without an fsync of its own: after a node crash it may lag the segment (a
weaker check there, never a false one); with ``sync=False`` the segment itself may
lag after a node crash, and the reopen then says what was lost.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from arrowbuf._checks import check_bool, check_int
from arrowbuf._dirlock import FILE_MODE, DirectoryLock
from arrowbuf._filesink import fsync
from arrowbuf._log_records import (HEAD_NAME, SEGMENT, Batch, Head, Record, episodes_batch, episodes_schema,
                                  read_segment, record_header, segment_name, stream)
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import ArrowbufError, FormatError
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode

logger = logging.getLogger("arrowbuf")

_MAX_WRITERS = 4096                      # writers whose batches are remembered (the most recent ones)
_WINDOW = 1024                           # batch numbers of a writer kept above its first gap
_BATCH_IDS = 4096                        # recent batches whose episode ids are kept, for retries


def next_episode_id(engine: ShardEngine) -> int:
    """The id the engine's next stored episode gets."""
    if engine.shard is None:
        return engine.shard_index
    table = engine.table
    return table.episode_id_of(table.episodes_added)



class EpisodeLog:
    """The append-only episode log of one engine, in segment files of ``directory``.

    Opening the log locks the directory (`arrowbuf._dirlock`: one writer at a
    time, released by the OS when its process ends), reads and checks every
    segment against the head and the segments' start records, drops a torn last
    record, and keeps the records for `replay`.

    Args:
        directory: where the segments live (created 0700 if missing).
        segment_bytes: a segment this large is closed and a new one started.
        sync: flush each append to disk (``fdatasync``) before it returns; False
            leaves it to the OS: appends survive a dead process, not a node crash
            (after one, the reopen may raise `FormatError` for appends it lost).
        lock_wait: seconds to wait for another process's lock on the directory.
        holder: what names this process in the lock file, beside its pid and host.

    Raises:
        InUseError: another process has the directory open.
        FormatError: a damaged record or segment (never a torn last record), a
            deleted segment, or a newest segment cut below its acknowledged appends.
        ValueError: a bad argument.
    """

    def __init__(self, directory: str | os.PathLike, *, segment_bytes: int = 64 << 20, sync: bool = True,
                 lock_wait: float = 0.0, holder: str | None = None) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"directory must be a path, got {directory!r}")
        self.directory = Path(directory)
        self.segment_bytes = check_int("segment_bytes", segment_bytes, 1)
        self.sync = check_bool("sync", sync)
        self._dirlock = DirectoryLock(self.directory, lock_wait, holder)
        self._lock = threading.Lock()
        # writer -> [n, [numbers above n]]: its batches 1..n and those listed are logged.
        # Exact whatever order retries come in; a number that never comes (a write
        # refused before it was logged) is passed over once _WINDOW later ones came.
        self.batches: dict[str, list] = {}
        self._batch_ids: dict[Batch, list[int]] = {}   # the most recent batches' ids: what a retry is answered
        self._records: list[Record] | None = []  # kept from opening until `replay`
        self._segments: list[tuple[Path, int]] = []   # sealed segments and the next id after their records
        self._next_after = 0
        self._arrow_schema: tuple[Schema, pa.Schema] | None = None   # of the last append, reused
        self._head_fd: int | None = None
        self._file: Any = None
        self.acked_next = 0      # every acknowledged episode's id is below it
        self._covered = 0        # the last compaction's checkpoint holds every episode below it
        self._acked_records = 0  # records acknowledged in the active segment after its start
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        head = Head.read(self.directory / HEAD_NAME)
        numbers = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := SEGMENT.fullmatch(p.name)))
        if head is not None:
            for number in [n for n in numbers if n < head.first]:   # a compaction stopped after moving the head on
                (self.directory / segment_name(number)).unlink()
            numbers = [n for n in numbers if n >= head.first]
        missing = [n for n in range(head.first, head.newest + 1) if n not in numbers] if head is not None else []
        gaps = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers)) if numbers else []
        if gaps and not missing:
            raise FormatError(f"{self.directory / segment_name(gaps[0])}: missing (deleted) between "
                              f"{segment_name(numbers[0])} and {segment_name(numbers[-1])}; the episodes and clears "
                              "logged in it cannot be vouched for")
        paths = [self.directory / segment_name(n) for n in numbers]
        read = []
        for k, path in enumerate(paths):
            newest = k == len(paths) - 1
            records, end = read_segment(path, last=newest)
            size = path.stat().st_size
            if records and records[0].kind != "start" or not records and not newest:
                raise FormatError(f"{path}: does not begin with a start record; the segment was cut or emptied, "
                                  "and the episodes logged in it cannot be vouched for")
            read.append((path, records, end, size))
        for (path, _, _, size), (_, records, _, _) in zip(read, read[1:]):
            previous = records[0].meta.get("previous") if records else None
            number = int(SEGMENT.fullmatch(path.name).group(1))
            if previous is not None and previous[0] == number and previous[1] != size:   # (a gap is said below)
                raise FormatError(f"{path}: {size} bytes, but the next segment's start record says it ended at "
                                  f"byte {previous[1]}; it was cut, and the episodes logged past byte {size} "
                                  "cannot be vouched for")
        for path, records, _, _ in read:
            for record in records:
                self._note(record)
            self._records += records
            self._segments.append((path, self._next_after))
        if missing:   # said after reading the others: what they hold is vouched for
            lost = (f"; {self._unvouched(head)} cannot be vouched for" if head.newest in missing else
                    ": the episodes and clears logged in it cannot be vouched for")
            raise FormatError(f"{self.directory / segment_name(missing[0])}: missing (deleted); the log head "
                              f"({HEAD_NAME}) lists segments {head.first}..{head.newest}{lost}")
        if head is not None:
            self.acked_next = max(self.acked_next, head.acked_next)
            self._covered = head.covered
        torn = None
        if read:
            path, records, end, size = read[-1]
            number = numbers[-1]
            if head is not None and number == head.newest and end < head.acked_bytes:
                raise FormatError(f"{path}: its records end at byte {end}, but appends to it were acknowledged up to "
                                  f"byte {head.acked_bytes} ({head.acked_records} records after its start); the "
                                  f"segment was cut or emptied, and {self._unvouched(head)} cannot be vouched for")
            if head is None and any(r[1] and r[1][0].meta.get("head") for r in read) and not (
                    len(read) == 1 and len(records) <= 1):
                raise FormatError(f"{self.directory / HEAD_NAME}: missing (deleted); the segments say this log keeps "
                                  "one (it records the newest segment and how far its appends were acknowledged), "
                                  "so the newest episodes cannot be vouched for")
            torn = (path, end, size) if end < size else None
        # Verdict given: what remains is a crash's (a torn, never acknowledged, last record or segment).
        if torn is not None:
            path, end, size = torn
            logger.warning("%s: dropping a torn last record (%d bytes) of an append that never returned",
                           path, size - end)
            os.truncate(path, end)
        self._head_fd = os.open(self.directory / HEAD_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        self._first = numbers[0] if numbers else 0
        if self._segments and self._segments[-1][0].stat().st_size == 0:
            self._segments.pop()[0].unlink()   # a segment whose start record was torn
        if self._segments:
            self._active_path = self._segments.pop()[0]
            self._file = open(self._active_path, "ab")
            self._acked_records = max(0, {p: len(r) for p, r, _, _ in read}[self._active_path] - 1)
            self._set_head(durable=True)
        else:
            self._start_segment(self._first, None)

    def _unvouched(self, head: Head) -> str:
        """What a log cut before its head's acknowledged appends may have lost."""
        logged = max(self._next_after, head.covered)   # the log's records, or the last checkpoint, hold the rest
        if head.acked_next > logged:
            return (f"episodes {logged}..{head.acked_next - 1} (acknowledged; neither the readable records nor "
                    "the last checkpoint hold them) and any clear logged after them")
        if head.acked_records == 0:
            return (f"the start record of segment {head.newest} (the writers' batch numbers that recognise a "
                    "retried write)")
        return f"the {head.acked_records} acknowledged appends of segment {head.newest} (their episodes and clears)"

    def _set_head(self, durable: bool = False) -> None:
        """Record the active segment and its acknowledged end in the head (after the append's bytes are
        flushed: the head never claims more than the segment holds). ``durable``: flushed too (a new segment)."""
        number = int(SEGMENT.fullmatch(self._active_path.name).group(1))
        head = Head(self._first, number, self._file.tell(), self._acked_records, self.acked_next, self._covered)
        os.pwrite(self._head_fd, head.pack(), 0)
        if durable and self.sync:
            os.fsync(self._head_fd)
            fsync(self.directory)

    def _note(self, record: Record) -> None:
        if record.kind == "start":
            self.batches.update(record.meta["writers"])
        elif record.kind == "clear":
            self._next_after = max(self._next_after, int(record.meta["next_id"]) + 1)
        else:
            ids = record.ids()
            if ids:
                self._next_after = max(self._next_after, ids[-1] + 1)
                self.acked_next = max(self.acked_next, ids[-1] + 1)
        if record.batch is not None:
            self._remember(record.batch, record.ids() if record.kind == "episodes" else [])

    def _remember(self, batch: Batch, ids: list[int]) -> None:
        self._batch_ids[batch] = ids
        while len(self._batch_ids) > _BATCH_IDS:
            del self._batch_ids[next(iter(self._batch_ids))]
        writer, number = batch
        upto, above = self.batches.pop(writer, [0, []])   # newest last: the oldest writers are forgotten first
        if number > upto and number not in above:
            bisect.insort(above, number)
        while above and (above[0] == upto + 1 or len(above) > _WINDOW):
            upto = above.pop(0)
        self.batches[writer] = [upto, above]
        while len(self.batches) > _MAX_WRITERS:
            del self.batches[next(iter(self.batches))]

    def _start_segment(self, number: int, previous: list[int] | None) -> None:
        self._active_path = self.directory / segment_name(number)
        fd = os.open(self._active_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)
        self._file = os.fdopen(fd, "ab")
        self._write(stream(pa.schema([]), {"kind": "start", "writers": self.batches, "previous": previous,
                                           "head": True}))
        if self.sync:
            fsync(self.directory)
        self._acked_records = 0
        self._set_head(durable=True)

    def _write(self, payload: pa.Buffer) -> None:
        """Append one record and flush it; a failed append leaves no partial record behind."""
        header = record_header(payload)
        start = self._file.tell()
        try:
            self._file.write(header)
            self._file.write(memoryview(payload))
            self._file.flush()
            if self.sync:
                os.fdatasync(self._file.fileno())
        except BaseException:
            self._file.truncate(start)
            raise

    def _acknowledge(self) -> None:
        """An append's record is flushed: the head moves past it (then the append returns)."""
        self._acked_records += 1
        self._set_head()

    # -- appending ------------------------------------------------------------------------

    def seen(self, batch: Batch) -> bool:
        """Whether the writer's batch number ``batch[1]`` is logged."""
        upto, above = self.batches.get(batch[0], (0, ()))
        return batch[1] <= upto or batch[1] in above

    def logged_ids(self, batch: Batch) -> list[int] | None:
        """The episode ids a logged batch was stored under (None: not among the recent ones kept)."""
        return self._batch_ids.get(batch)

    def append(self, episodes: Sequence[tuple[int, Episode, int]], schema: Schema,
               batch: Batch | None = None, owner: str | None = None,
               closes: tuple[list[str], int] | None = None) -> None:
        """Log stored episodes as one record and flush it to disk before returning.

        Args:
            episodes: (episode id, episode, inserted_at ns) in the order they were stored.
            schema: the engine's schema.
            batch: (writer id, batch number) of the write they came in, for `seen`.
            owner: whose open pieces they are (`arrowbuf.ray.tails`: logged with each piece's
                link, ``Episode.prev_piece``, and ``Episode.open``, so a replay links them again).
            closes: (env ids, the engine's next episode id after the episodes) of ``owner``'s
                open episodes that ended with this write.
        """
        if self._arrow_schema is None or self._arrow_schema[0] != schema:
            self._arrow_schema = (schema, episodes_schema(schema))
        arrow_schema = self._arrow_schema[1]
        meta: dict[str, Any] = {"kind": "episodes", "batch": list(batch) if batch is not None else None}
        if any(e.first_step for _, e, _ in episodes):   # pieces that continue an episode (`arrowbuf.piece_cutting`)
            meta["first_steps"] = [int(e.first_step) for _, e, _ in episodes]
        if any(e.open or e.prev_piece >= 0 for _, e, _ in episodes):   # linked pieces (`arrowbuf.ray.tails`)
            meta["pieces"] = [[int(e.prev_piece), bool(e.open), owner] for _, e, _ in episodes]
        if closes:
            meta["closes"] = {"owner": owner, "envs": list(closes[0]), "next_id": int(closes[1])}
        payload = stream(arrow_schema, meta, [episodes_batch(arrow_schema, schema, episodes)] if episodes else [])
        with self._lock:
            self._rotate_if_full()
            self._write(payload)
            if episodes:   # what `compact` asks of the segment holding this record
                self._next_after = max(self._next_after, max(i for i, _, _ in episodes) + 1)
                self.acked_next = max(self.acked_next, max(i for i, _, _ in episodes) + 1)
            self._acknowledge()
            if batch is not None:
                self._remember(batch, [i for i, _, _ in episodes])

    def append_clear(self, next_id: int) -> None:
        """Log that the engine was cleared when its next episode id was ``next_id``."""
        with self._lock:
            self._rotate_if_full()
            self._write(stream(pa.schema([]), {"kind": "clear", "next_id": int(next_id)}))
            self._next_after = max(self._next_after, int(next_id) + 1)
            self._acknowledge()

    def _rotate_if_full(self) -> None:
        if self._file.tell() >= self.segment_bytes:
            self._rotate()

    def _rotate(self) -> None:
        number = int(SEGMENT.fullmatch(self._active_path.name).group(1))
        previous = [number, self._file.tell()]   # the next start record names this segment's end
        self._file.close()
        self._segments.append((self._active_path, self._next_after))
        self._start_segment(number + 1, previous)

    # -- replay and compaction ------------------------------------------------------------

    def replay(self, engine: ShardEngine, pieces: Any = None) -> int:
        """Add the logged episodes the engine does not hold yet; returns how many.

        ``pieces`` (an `arrowbuf.ray.tails.OpenPieces`) is told each replayed piece's owner
        (``stored``) and the open episodes that ended after the engine's last held episode
        (``close``): a shard's open pieces as they were.

        Episodes whose id is below the engine's next id are in it already (from
        its checkpoint) and skipped; the others must come in id order. A clear is
        replayed where the engine reaches the next id it logged: a threaded
        shard may log a clear before the record of an episode inserted before
        it, and an episode inserted but never logged (its write unanswered when
        the shard died) leaves the clear to the end of the log.

        Raises:
            FormatError: the log skips episodes the engine never stored, or an
                episode the engine refuses.
        """
        with self._lock:
            records, self._records = self._records or [], None
        added, clear_at = 0, None   # the next id of a clear waiting for episodes logged after it
        held = next_episode_id(engine)   # a close logged before it is in the engine's checkpoint
        for record in records:
            if record.kind == "clear":
                mark = int(record.meta["next_id"])
                if mark == next_episode_id(engine):
                    engine.clear()
                    if pieces is not None:
                        pieces.clear()
                elif mark > next_episode_id(engine):
                    clear_at = mark
                continue
            if record.kind != "episodes":
                continue
            for owner, (logged, episode) in zip(record.owners(), record.episodes()):
                expected = next_episode_id(engine)
                if logged < expected:
                    continue
                if logged > expected:
                    raise FormatError(f"{record.where}: episode {logged} follows episode {expected - 1} of the "
                                      f"checkpoint; the episodes between them are missing from the log")
                try:
                    stored = engine.add(episode, record.schema, limited=False)
                except (ArrowbufError, ValueError) as err:
                    raise FormatError(f"{record.where}: the engine refuses logged episode {logged} ({err})") from None
                if stored != logged:
                    raise FormatError(f"{record.where}: episode {logged} was stored as {stored}; the log belongs "
                                      "to another shard")
                added += 1
                if pieces is not None:
                    pieces.stored(owner, episode, engine.table.episodes_added - 1)
                if clear_at is not None and next_episode_id(engine) >= clear_at:
                    engine.clear()
                    if pieces is not None:
                        pieces.clear()
                    clear_at = None
            closes = record.closes()
            if pieces is not None and closes is not None and closes[2] >= held:
                pieces.close(closes[0], closes[1])
        if clear_at is not None:
            engine.clear()
            if pieces is not None:
                pieces.clear()
        return added

    def compact(self, upto: int) -> int:
        """Start a new segment and delete the older ones a checkpoint covers; returns how many.

        Args:
            upto: the next episode id of the checkpoint: every episode with a smaller
                id is in it (or was evicted before it).
        """
        with self._lock:
            self._rotate()
            covered = [path for path, next_after in self._segments if next_after <= upto]
            kept = [p for p, _ in self._segments if p not in covered] + [self._active_path]
            self._first = int(SEGMENT.fullmatch(kept[0].name).group(1))
            self._covered = max(self._covered, upto)
            self._set_head(durable=True)   # first: a crash before the unlinks leaves covered segments below it
            for path in covered:
                path.unlink()
            self._segments = [(p, n) for p, n in self._segments if p not in covered]
            if self.sync:
                fsync(self.directory)
            return len(covered)

    def segments(self) -> list[Path]:
        """The segment files, oldest first (the last one is appended to)."""
        return [path for path, _ in self._segments] + [self._active_path]

    def close(self) -> None:
        """Close the files and release the directory's lock."""
        if self._file is not None:
            self._file.close()
        if self._head_fd is not None:
            os.close(self._head_fd)
            self._head_fd = None
        self._dirlock.release()

    def __enter__(self) -> "EpisodeLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
