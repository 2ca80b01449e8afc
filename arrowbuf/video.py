"""Video fields of a LeRobot v3 dataset: frames decoded from their MP4 files at gather.

A video field reads like a uint8 ``(H, W, C)`` observation field, but a dataset's cache
holds none of its pixels: per row it stores which frame of which file the row is
(`FRAME_REF`: the file's position in `VideoSpec.files` and the frame's number in that
file, its time x fps). `VideoColumn` is the field's column in the dataset's arena: its
`take` decodes the frames of rows straight into a buffer, as
`arrowbuf.encoded.EncodedColumn`'s decodes encoded rows, and a gather decodes a batch's
video fields as it decodes its encoded ones (`arrowbuf.encoded.BatchDecodes`): every
frame it wants (observations, next observations: the next frame of the same episode,
frame stacks) in one call of `VideoReader.decode`, each distinct frame once.

Decoding (PyAV, the FFmpeg in its wheel): a gather's frames are looked up in the
dataset's `FrameCache` (decoded frames, the least recently used out past its byte
bound); the others are grouped by file and decoded in time order (`VideoFile.read`):
one seek to the keyframe at or before the first, then forward, seeking again only
where that skips frames (a keyframe known to lie past the frame decoded last, or a gap
wider than the keyframe spacing seen so far): a seek costs a decode from its keyframe
on, and a gather that seeks for every frame runs many times slower than one that reads
on. Frames decoded on the way to a wanted one (from its keyframe on) are cached too, and
converted to RGB only when a later gather asks for them.

Damaged files (unreadable, truncated, a frame missing, another size than the field's)
raise `FormatError` naming the file and the field.

Example:
    >>> import av, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "camera.mp4")
    >>> with av.open(path, "w") as out:
    ...     stream = out.add_stream("mpeg4", rate=10)
    ...     stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
    ...     for t in range(6):
    ...         image = np.full((16, 32, 3), 40 * t, np.uint8)
    ...         out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
    ...     out.mux(stream.encode())
    >>> spec = VideoSpec("camera", ("camera.mp4",), 10.0, (16, 32, 3))
    >>> refs = np.array([[0, t] for t in range(6)], np.int32)        # row t: frame t of file 0
    >>> column = VideoReader(Path(path).parent, cache_bytes=1 << 20).column("camera", spec, refs)
    >>> frames = column.take(np.array([4, 1]))                       # grays 160 and 40, within the loss
    >>> frames.shape, bool(np.abs(frames[:, 0, 0, 0] - np.array([160, 40])).max() < 8)
    ((2, 16, 32, 3), True)
    >>> int(column[5][0, 0, 0]) > 180                                   # frame 5 (200)
    True
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from arrowbuf.encoded import Request
from arrowbuf.errors import FormatError
from arrowbuf.fields import Field

#: What the cache stores per row of a video field: (file, frame number in that file).
FRAME_REF = Field("int32", (2,))
#: Default ``video_cache_bytes`` of `arrowbuf.open_dataset`: decoded frames a dataset keeps.
VIDEO_CACHE_BYTES = 256 << 20
#: Video files a dataset keeps open (each holds its container's index and decoder).
MAX_OPEN_FILES = 32
#: Frames a seek must save decoding to be taken rather than decoding on: measured on 224x224
#: AV1 (keyframes every 2 frames, LeRobot's default) and H.264 (every 2 and 30), a seek costs
#: less than decoding one frame.
SEEK_SKIP = 1
#: Frames of fewer pixels than this are decoded on one thread (see `VideoFile._open`).
ONE_THREAD_PIXELS = 1 << 17
_FORMATS = {3: "rgb24", 1: "gray"}


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ImportError("decoding a dataset's video fields needs PyAV: pip install 'arrowbuf[video]' (or av); "
                          "sample with keys=[...] leaving the video fields out to read the rest without it") from None
    return av


@dataclass(frozen=True)
class VideoSpec:
    """One video field as a dataset's cache records it.

    Args:
        key: the source's name of the feature (LeRobot's ``observation.images.front``).
        files: the field's video files, relative to the source directory; `FRAME_REF`'s
            first value is a position in this tuple.
        fps: frames a second: frame ``n`` of a file is the one shown at ``n / fps`` s.
        shape: a decoded frame's (H, W, C), C 3 (RGB) or 1 (gray).
    """

    key: str
    files: tuple[str, ...]
    fps: float
    shape: tuple[int, int, int]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "files": list(self.files), "fps": self.fps, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, entry: Any, where: str) -> "VideoSpec":
        """The spec a cache manifest records.

        Raises:
            FormatError: not a complete, well-typed entry.
        """
        try:
            spec = cls(str(entry["key"]), tuple(str(f) for f in entry["files"]), float(entry["fps"]),
                       tuple(int(s) for s in entry["shape"]))
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(f"{where}: not a video field's entry ({err!r}): {entry!r}") from None
        if len(spec.shape) != 3 or spec.shape[2] not in _FORMATS or min(spec.shape) < 1 or not spec.fps > 0 \
                or not spec.files:
            raise FormatError(f"{where}: a video field of shape {spec.shape}, fps {spec.fps}, {len(spec.files)} "
                              "files; expected (H, W, 1 or 3), fps > 0 and some files")
        return spec


class FrameCache:
    """Decoded frames by (file, frame number), least recently used out past ``max_bytes``.

    A value is a frame's RGB array, or a frame decoded on the way to another one, kept
    as the decoder gave it (``(av.VideoFrame, VideoFile)``) until a gather wants it.
    Counters: ``hits`` and ``misses`` of gathers' lookups, ``decoded`` frames decoded
    from files (wanted ones and those on the way).

    Example:
        >>> cache = FrameCache(max_bytes=100)
        >>> cache.put((0, 1), np.zeros(60, np.uint8)); cache.put((0, 2), np.zeros(60, np.uint8))
        >>> cache.get((0, 1)) is None, cache.get((0, 2)).shape, cache.nbytes   # (0, 1) made room
        (True, (60,), 60)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = self.misses = self.decoded = 0
        self._entries: OrderedDict[tuple[int, int], tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, int]) -> Any:
        """The value at ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple[int, int], value: Any, nbytes: int | None = None) -> None:
        """Keep ``value`` (of ``nbytes``; default: the bytes an array spans, its rows' padding
        included) at ``key``, dropping the least recently used past the bound; a value larger
        than the bound is not kept."""
        if nbytes is None:
            nbytes = abs(value.strides[0]) * value.shape[0] if value.ndim else value.nbytes
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        if nbytes > self.max_bytes:
            return
        while self.nbytes + nbytes > self.max_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1][1]
        self._entries[key] = (value, nbytes)
        self.nbytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


class VideoFile:
    """One video file of a field: its open container (opened when read, closed by the
    reader past `MAX_OPEN_FILES`) and what decoding it taught: the keyframes seen and the
    widest keyframe spacing met, which `read` seeks by."""

    def __init__(self, path: Path, field: str, spec: VideoSpec, uid: int) -> None:
        self.path, self.field, self.uid = path, field, uid
        self.fps, self.shape = spec.fps, spec.shape
        self._size, self._format = tuple(spec.shape[:2]), _FORMATS[spec.shape[2]]
        self.keyframes: list[int] = []
        self.gop = 0
        self._container: Any = None

    def _fail(self, what: str) -> FormatError:
        self.close()
        return FormatError(f"{self.path}: video of field {self.field!r}: {what}")

    def _open(self) -> None:
        av = _av()
        from av.video.reformatter import VideoReformatter
        try:
            container = av.open(str(self.path))
        except (av.FFmpegError, OSError) as err:
            raise self._fail(f"unreadable ({err}); the file is missing, truncated or not a video") from None
        if not container.streams.video:
            container.close()
            raise self._fail("holds no video stream")
        stream = container.streams.video[0]
        # Slice threads, not frame threads: frames in flight in other threads are decoded for
        # nothing at each seek (random batches of H.264 frames took 1.6x as long with them).
        # Small frames decode on one thread: a seek restarts the decoder's threads, which cost
        # more than they save below `ONE_THREAD_PIXELS` (a seek and a keyframe of AV1: 33 us
        # on one thread, 103 us on two at 64x48; 131 and 216 us at 224x224; 1.4 and 1.1 ms at 640x480).
        stream.thread_type = "SLICE"
        if self.shape[0] * self.shape[1] < ONE_THREAD_PIXELS:
            stream.thread_count = 1
        self._container, self._stream = container, stream
        self._tick = float(stream.time_base) * self.fps       # frames per pts unit
        self._start = stream.start_time or 0
        self._reformat = VideoReformatter()

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None

    def rgb(self, frame: Any) -> np.ndarray:
        """A decoded frame as the field's uint8 (H, W, C) array: a view of the converted
        frame's buffer (its rows may be padded), copied once, into the batch.

        Raises:
            FormatError: the frame is not of the field's size.
        """
        if (frame.height, frame.width) != self._size:
            raise self._fail(f"frames of {frame.height}x{frame.width}, the field's are {self.shape[0]}x{self.shape[1]}")
        try:
            # One thread: swscale's own threads cost ~25 us a call, more than converting a
            # 64x48 frame (5 us), no gain at 224x224, and 2x at 640x480 on 2 busy cores.
            converted = self._reformat.reformat(frame, format=self._format, threads=1)
        except TypeError:   # a PyAV without ``threads=`` (its conversions took one thread)
            converted = self._reformat.reformat(frame, format=self._format)
        image = converted.to_ndarray()
        return image if image.ndim == 3 else image[..., None]

    def read(self, wanted: list[int], cache: FrameCache, deliver: Callable[[int, np.ndarray], None]) -> None:
        """Decode the frames numbered ``wanted`` (sorted, distinct) in that order, with as few
        seeks as pay (see the module docstring), and ``deliver(k, frame)`` the k-th as it
        comes (its memory is reused once let go); frames decoded on the way go into ``cache``.

        Raises:
            FormatError: the file is unreadable or damaged, or lacks a wanted frame.
        """
        av = _av()
        if self._container is None:
            self._open()
        frames, at, start = None, -1, -1   # the decoding run, the frame it gave last, its first frame
        kept = 0                           # bytes of a frame decoded on the way (its planes), once known
        first, tick, decoded = self._start, self._tick, 0
        try:
            for k, w in enumerate(wanted):
                if frames is None or self._seeks(at, w):
                    frames, before, start = self._seek(w), at, -1
                for frame in frames:
                    pts = frame.pts
                    if pts is None:
                        raise self._fail("a frame without a timestamp")
                    n = round((pts - first) * tick)
                    if start < 0:
                        start = n
                        if n <= before:   # the seek went back: no keyframe lies in (n, w]
                            self.gop = max(self.gop, w - n + 1)
                    if frame.key_frame:
                        self._learn(n, start)
                    decoded += 1
                    if n == w:
                        at = n
                        deliver(k, self.rgb(frame))
                        break
                    if n > w:
                        raise self._fail(f"frame {w} (at {w / self.fps:.3f} s) is missing: frame {n} follows "
                                         f"frame {at}")
                    at = n
                    if cache.max_bytes:
                        kept = kept or sum(plane.buffer_size for plane in frame.planes)
                        cache.put((self.uid, n), (frame, self), kept)
                else:
                    raise self._fail(f"frame {w} (at {w / self.fps:.3f} s) is past its last frame ({at}); the "
                                     "file is truncated, or the dataset's timestamps are not its")
        except (av.FFmpegError, OSError) as err:
            raise self._fail(f"undecodable ({err}); the file is truncated or damaged") from None
        finally:
            cache.decoded += decoded

    def _seeks(self, at: int, w: int) -> bool:
        """Whether to reach frame ``w`` by a seek rather than by decoding on from frame ``at``."""
        known = self.keyframes
        k = bisect.bisect_right(known, w)
        if k and known[k - 1] > at + SEEK_SKIP:   # a keyframe past ``at`` and at or before ``w``
            return True
        between = k and known[k - 1] > at
        return not between and w - at > max(self.gop, SEEK_SKIP)

    def _seek(self, w: int) -> Any:
        """Frames decoded from the keyframe at or before frame ``w`` on."""
        target = self._start + int((w + 0.25) / self._tick)   # a quarter frame past it: never before it
        self._container.seek(target, stream=self._stream, backward=True)
        return self._container.decode(self._stream)

    def _learn(self, n: int, start: int) -> None:
        """Keyframe ``n`` seen, in a run of frames decoded on from frame ``start``."""
        known = self.keyframes
        k = bisect.bisect_left(known, n)
        if k == len(known) or known[k] != n:
            known.insert(k, n)
        if k and known[k - 1] >= start:   # every frame since the previous keyframe decoded: their spacing
            self.gop = max(self.gop, n - known[k - 1])


class VideoReader:
    """The video files and decoded-frame cache of one dataset; it makes the `VideoColumn`
    of each video field and decodes their gathers (one at a time: a lock).

    Args:
        root: the directory the fields' `VideoSpec.files` are relative to.
        cache_bytes: the `FrameCache` bound (0: nothing cached).
    """

    def __init__(self, root: Path, cache_bytes: int) -> None:
        self.root = root
        self.cache = FrameCache(cache_bytes)
        self._files: OrderedDict[int, VideoFile] = OrderedDict()   # open files, the least recently read first
        self._by_uid: dict[int, VideoFile] = {}
        self._lock = threading.Lock()
        self._uids = 0
        # A forked child must not read through its parent's open files: they share each
        # file's offset, so reads in one would move the other's.
        self._pid = os.getpid()

    def column(self, name: str, spec: VideoSpec, refs: np.ndarray) -> "VideoColumn":
        """The column of video field ``name``, whose row r is frame ``refs[r, 1]`` of file ``refs[r, 0]``."""
        files = []
        for file in spec.files:
            files.append(VideoFile(self.root / file, name, spec, self._uids))
            self._by_uid[self._uids] = files[-1]
            self._uids += 1
        return VideoColumn(name, refs, files, spec.shape, self)

    def decode(self, requests: Sequence[Request]) -> None:
        """Decode the frames of ``requests`` (`arrowbuf.encoded.Request`: rows of this reader's
        columns, in range, and the C-contiguous buffers they go to) together: each distinct
        frame once (an observation that is another row's next observation, or in several
        frame stacks), each file's frames in one pass in time order (a gather's observations
        and next observations: decoded in two passes, each next frame would cost a seek).

        Raises:
            FormatError: a video file is unreadable, damaged, or lacks a frame.
            ImportError: PyAV is not installed.
        """
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._close_files()
            places, keys = [], []
            for request in requests:
                refs = _checked_refs(request.source, request.rows)
                keys.append(request.source.uids[refs[:, 0]] << 32 | refs[:, 1])
                places.extend(request.out)   # each row's view
            keys = keys[0] if len(keys) == 1 else np.concatenate(keys)
            unique, inverse = np.unique(keys, return_inverse=True)
            into: list[list[Any]] = [[] for _ in range(len(unique))]   # the places of each distinct frame
            for place, u in zip(places, inverse.tolist()):
                into[u].append(place)
            cache, wanted = self.cache, unique.tolist()
            if cache.max_bytes or len(cache):
                missing = []
                for u, key in enumerate(wanted):
                    got = cache.get((key >> 32, key & 0xFFFFFFFF))
                    if type(got) is tuple:   # decoded on the way to another frame: converted now
                        got = got[1].rgb(got[0])
                        cache.put((key >> 32, key & 0xFFFFFFFF), got)
                    if got is None:
                        missing.append(u)
                    else:
                        for place in into[u]:
                            place[...] = got
            else:
                missing = list(range(len(wanted)))
                cache.misses += len(wanted)
            start = 0
            while start < len(missing):   # each file's frames in time order (keys sort so)
                uid = wanted[missing[start]] >> 32
                stop = start + 1
                while stop < len(missing) and wanted[missing[stop]] >> 32 == uid:
                    stop += 1
                self._read(self._by_uid[uid], [wanted[u] & 0xFFFFFFFF for u in missing[start:stop]],
                           [into[u] for u in missing[start:stop]])
                start = stop

    def _read(self, file: VideoFile, frames: list[int], places: list[list[Any]]) -> None:
        """Decode ``frames`` (sorted, distinct) of ``file`` into ``places`` (each frame's views), and cache them."""
        cache, uid = self.cache, file.uid

        def deliver(k: int, image: np.ndarray) -> None:
            for place in places[k]:
                place[...] = image
            if cache.max_bytes:
                cache.put((uid, frames[k]), image)

        self._opened(file).read(frames, cache, deliver)

    def _opened(self, file: VideoFile) -> VideoFile:
        """``file``, counted as read now; the least recently read past `MAX_OPEN_FILES` are closed."""
        self._files.pop(file.uid, None)
        self._files[file.uid] = file
        while len(self._files) > MAX_OPEN_FILES:
            self._files.popitem(last=False)[1].close()
        return file

    def _close_files(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def close(self) -> None:
        with self._lock:
            self._close_files()
            self.cache.clear()


def _checked_refs(column: "VideoColumn", rows: np.ndarray) -> np.ndarray:
    """The frame references of ``rows`` of ``column``, each naming one of its files and a frame.

    Raises:
        FormatError: a reference that does not (a damaged cache: a negative file index would read
            another file's frame).
    """
    refs = np.asarray(column.refs[rows], np.int64)
    bad = (refs[:, 0] < 0) | (refs[:, 0] >= len(column.files)) | (refs[:, 1] < 0)
    if bad.any():
        at = int(np.argmax(bad))
        raise FormatError(f"video field {column.name!r}: row {int(np.asarray(rows)[at])} refers to frame "
                          f"{int(refs[at, 1])} of file {int(refs[at, 0])} of {len(column.files)}; the cache is "
                          "damaged (open the source with verify=True, or delete the cache, to convert again)")
    return refs


class VideoColumn:
    """The rows of a video field, read as the uint8 (H, W, C) frames they reference.

    Reads like a numpy column of its frames (``shape``, ``dtype``, ``take``, indexing)
    and decodes the frames it is asked for (`VideoReader.decode`). A gather decodes a
    batch's video fields with its encoded ones (`arrowbuf.encoded.BatchDecodes`), through
    `decode_requests`: all the frames of one dataset's videos in one call, so an
    observation and its next observation come from one pass over the file. Made by
    `VideoReader.column`.
    """

    def __init__(self, name: str, refs: np.ndarray, files: list[VideoFile], shape: tuple[int, ...],
                 reader: VideoReader) -> None:
        self.name, self.refs, self.files, self.reader = name, refs, files, reader
        self.uids = np.array([file.uid for file in files], np.int64)   # by position in ``files``
        self.row_shape = tuple(shape)
        self.dtype = np.dtype(np.uint8)
        self.shape = (len(refs), *self.row_shape)
        self.ndim = len(self.shape)
        self.nbytes = refs.nbytes

    @property
    def decode_requests(self) -> Callable[[Sequence[Request]], None]:
        """What decodes requests of this column's rows: its reader's `VideoReader.decode` (the same
        for every video field of a dataset: a batch's requests of them are decoded together)."""
        return self.reader.decode

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        """The frames of rows ``key`` (an int: one frame)."""
        if isinstance(key, (int, np.integer)):
            return self[np.array([key])][0]
        rows = np.arange(*key.indices(len(self)), dtype=np.int64) if isinstance(key, slice) \
            else np.asarray(key, np.int64).reshape(-1)
        return self.take(rows, 0, None, "raise")

    def take(self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "raise") -> np.ndarray:
        """Decode the frames of rows ``indices`` (any shape) into ``out`` (``indices.shape + (H, W, C)``), as ``np.take``.

        Raises:
            FormatError: a video file is unreadable, damaged, or lacks a frame.
            ImportError: PyAV is not installed.
        """
        indices = np.asarray(indices)
        flat = indices.reshape(-1).astype(np.int64, copy=False)
        if mode == "clip":
            flat = np.clip(flat, 0, len(self) - 1)
        elif flat.size and (flat.min() < -len(self) or flat.max() >= len(self)):
            raise IndexError(f"row index out of range for a column of {len(self)} rows")
        if out is None:
            out = np.empty((*indices.shape, *self.row_shape), self.dtype)
        target = out if out.flags.c_contiguous else np.empty(out.shape, self.dtype)
        if flat.size:
            self.reader.decode([Request(self, flat, target.reshape(len(flat), *self.row_shape))])
        if target is not out:
            out[...] = target
        return out
