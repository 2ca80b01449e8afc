"""Image codecs of encoded fields: ``ab.Field("uint8", (H, W, C), codec="jpeg:90")``.

A codec turns one row (a uint8 ``(H, W, C)`` image for ``jpeg`` and ``png``, any
fixed shape and dtype for ``zstd``) into bytes when it is written, and the bytes
back into the row's buffer when it is gathered. Rows are encoded and decoded on a
shared thread pool (`map_rows`): libjpeg-turbo (simplejpeg) and zstd release the
GIL, so a batch of 256 rows decodes on every core.

- ``"jpeg"``, ``"jpeg:Q"``: lossy, quality Q (default 90), 4:2:0 chroma subsampling
  as libjpeg's default (simplejpeg's own default, 4:4:4, stores ~25% more); 1 or 3
  channels.
- ``"png"``: lossless (Pillow, compression level 1: level 6 took 3x longer for 3%
  fewer bytes on camera frames); 1, 3 or 4 channels.
- ``"zstd"``, ``"zstd:L"``: lossless zstd of the raw bytes, level L (default 3);
  any dtype and shape.

A row of zero bytes decodes to zeros: the value of a row never written (a derived
field, a final observation's step fields).

Example:
    >>> import numpy as np
    >>> codec = parse_codec("zstd", "float32", (4,), "x")
    >>> out = np.empty(4, np.float32)
    >>> codec.decode(codec.encode(np.arange(4, dtype=np.float32)), out)
    >>> out.tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from arrowbuf.errors import FormatError, SchemaError

CODECS = ("jpeg", "png", "zstd")

#: Rows per pool task at most: a 224x224 JPEG decodes in ~0.2 ms, so a task of 8 rows outweighs
#: the pool's ~20 us of handing it out, and a batch of 512 rows makes 64 tasks (no long tail).
_CHUNK = 8
#: Decoded bytes of a call's rows below which they are coded on the caller's thread: ~250 us of
#: JPEG (a 224x224x3 frame, 150 KB, encodes in ~130 us and decodes in ~180 us), about what
#: handing tasks to the pool and waiting for them is worth. Above it even 2 rows are split.
_SERIAL_BYTES = 256 << 10

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


def map_rows(work: Callable[[int], None], count: int, nbytes: int) -> None:
    """Run ``work(i)`` for i in range(count), on this thread and the codec pool's; the first
    exception (by row) is raised here, after every task has ended (a task stops at its error).

    The work is sized by ``nbytes``, the decoded bytes of all ``count`` rows (rows x row bytes),
    not by the count: rows of less than `_SERIAL_BYTES` in all run on this thread; more are split
    into tasks of at most `_CHUNK` rows, and into at least one task a thread (4 camera frames of a
    step writer's envs: 2 tasks of 2 rows on 2 threads). This thread runs tasks too, taking them
    from the same queue as its helpers on the pool, and helpers that have not started when the
    queue is empty are cancelled: a helper woken late (a core busy with another process) costs
    nothing but its share, done here instead.
    """
    threads = _threads()
    if count < 2 or threads == 1 or nbytes < _SERIAL_BYTES:
        for i in range(count):
            work(i)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="arrowbuf-codec")
    per_task = min(_CHUNK, -(-count // threads))
    tasks = deque(range(0, count, per_task))   # task starts; popleft is thread-safe
    errors: list[tuple[int, BaseException]] = []

    def run() -> None:
        while True:
            try:
                start = tasks.popleft()
            except IndexError:
                return
            for i in range(start, min(start + per_task, count)):
                try:
                    work(i)
                except BaseException as error:   # raised by the caller, once every task has ended
                    errors.append((i, error))
                    break

    helpers = [_pool.submit(run) for _ in range(min(threads, len(tasks)) - 1)]
    run()
    for helper in helpers:
        if not helper.cancel():   # it started: its last task may still run
            helper.result()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]


class Codec:
    """One codec with its parameters: ``encode`` a row, ``decode`` bytes into a row buffer."""

    name = ""
    lossless = True

    def __init__(self, spec: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.spec, self.dtype, self.shape = spec, dtype, shape
        # Bytes of a decoded row: what sizes a batch's work (`map_rows`).
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)

    def encode(self, row: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        """Decode ``data`` into ``out`` (the row's dtype and shape); raises `FormatError` when
        the bytes are not one such row."""
        raise NotImplementedError

    def check(self, data: bytes | memoryview | np.ndarray) -> None:
        """Raise `FormatError` when ``data`` is plainly not a whole row of this codec: a header
        of another shape, a truncated end (a few microseconds: what rows written elsewhere,
        such as an import's, get before they are stored; a decode finds the rest)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __reduce__(self) -> tuple:
        # A codec holds its library's module: it pickles (a Ray block's rows) as what makes it.
        return parse_codec, (self.spec, self.dtype, self.shape)


class Jpeg(Codec):
    name, lossless = "jpeg", False

    def __init__(self, spec: str, dtype: str, shape: tuple[int, ...], quality: int = 90) -> None:
        super().__init__(spec, dtype, shape)
        import simplejpeg

        self._lib, self.quality = simplejpeg, quality
        self._colorspace = "RGB" if shape[2] == 3 else "GRAY"

    def encode(self, row: np.ndarray) -> bytes:
        return self._lib.encode_jpeg(np.ascontiguousarray(row), quality=self.quality, colorspace=self._colorspace,
                                     colorsubsampling="420" if self._colorspace == "RGB" else "Gray")

    def check(self, data: bytes | memoryview | np.ndarray) -> None:
        data = bytes(data)
        try:
            height, width, _, _ = self._lib.decode_jpeg_header(data)
        except (ValueError, RuntimeError) as err:
            raise FormatError(f"not a JPEG: {err}") from None
        whole = data.endswith(b"\xff\xd9")   # the end-of-image marker
        if (height, width) != self.shape[:2] or not whole:
            raise FormatError(f"a {height}x{width} JPEG{'' if whole else ' cut short'}; the field's rows are {self.shape}")

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        # No header parse first (`check`'s; rows stored were encoded here or checked): the decoded
        # image's shape says the same. A larger image does not fit ``out`` (ValueError); a smaller
        # one decodes into its first bytes and is refused here.
        try:
            image = self._lib.decode_jpeg(data, colorspace=self._colorspace, buffer=out)
        except (ValueError, RuntimeError) as err:
            raise FormatError(f"not a JPEG of shape {self.shape}: {err}") from None
        if image.shape[:2] != self.shape[:2]:
            raise FormatError(f"not a JPEG of shape {self.shape}: a {image.shape[0]}x{image.shape[1]} image")


class Png(Codec):
    name = "png"
    _modes = {1: "L", 3: "RGB", 4: "RGBA"}

    def __init__(self, spec: str, dtype: str, shape: tuple[int, ...]) -> None:
        super().__init__(spec, dtype, shape)
        from PIL import Image

        self._image = Image

    def encode(self, row: np.ndarray) -> bytes:
        image = self._image.fromarray(np.ascontiguousarray(row).reshape(self.shape[0], self.shape[1], -1).squeeze(2)
                                      if self.shape[2] == 1 else np.ascontiguousarray(row), self._modes[self.shape[2]])
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()

    def check(self, data: bytes | memoryview | np.ndarray) -> None:
        data = bytes(data)
        if not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR" or len(data) < 24:
            raise FormatError("not a PNG")
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        whole = data.endswith(b"IEND\xaeB`\x82")   # the last chunk
        if (height, width) != self.shape[:2] or not whole:
            raise FormatError(f"a {height}x{width} PNG{'' if whole else ' cut short'}; the field's rows are {self.shape}")

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        try:
            with self._image.open(io.BytesIO(data), formats=["PNG"]) as image:
                if image.mode != self._modes[self.shape[2]] or image.size != (self.shape[1], self.shape[0]):
                    raise ValueError(f"a {image.mode} image of {image.size[1]}x{image.size[0]}")
                out[...] = np.asarray(image).reshape(self.shape)
        except (OSError, ValueError, SyntaxError) as err:
            raise FormatError(f"not a PNG of shape {self.shape}: {err}") from None


class Zstd(Codec):
    name = "zstd"

    def __init__(self, spec: str, dtype: str, shape: tuple[int, ...], level: int = 3) -> None:
        super().__init__(spec, dtype, shape)
        import zstandard

        self._lib, self.level = zstandard, level
        self._local = threading.local()   # a zstd context is not thread-safe: one per thread

    def _contexts(self) -> tuple:
        found = getattr(self._local, "contexts", None)
        if found is None:
            found = self._local.contexts = (self._lib.ZstdCompressor(level=self.level), self._lib.ZstdDecompressor())
        return found

    def encode(self, row: np.ndarray) -> bytes:
        return self._contexts()[0].compress(np.ascontiguousarray(row).view(np.uint8).reshape(-1))

    def check(self, data: bytes | memoryview | np.ndarray) -> None:
        expected = self.row_bytes
        try:
            size = self._lib.frame_content_size(bytes(data))
        except self._lib.ZstdError as err:
            raise FormatError(f"not a zstd frame: {err}") from None
        if size != expected:
            raise FormatError(f"a zstd frame of {size} bytes; a row of shape {self.shape} has {expected}")

    def decode(self, data: bytes | memoryview, out: np.ndarray) -> None:
        target = out.view(np.uint8).reshape(-1)
        try:
            raw = self._contexts()[1].decompress(data, max_output_size=target.size)
        except self._lib.ZstdError as err:
            raise FormatError(f"not a zstd frame: {err}") from None
        if len(raw) != target.size:
            raise FormatError(f"a zstd frame of {len(raw)} bytes; a row of shape {self.shape} has {target.size}")
        target[...] = np.frombuffer(raw, np.uint8)


def parse_codec(spec: str, dtype: str, shape: tuple[int, ...], field: str = "") -> Codec:
    """The codec named by ``spec`` for a field of ``dtype`` and per-step ``shape``.

    Raises:
        SchemaError: naming ``field``, for an unknown codec or parameter, an image codec on
            a field that is not uint8 ``(H, W, C)`` with a channel count it can store, or a
            codec library that is not installed (with the ``pip install`` that adds it).
    """
    where = f"field {field!r}: " if field else ""
    if not isinstance(spec, str):
        raise SchemaError(f"{where}codec must be a string such as 'jpeg:90', got {spec!r}")
    name, _, param = spec.partition(":")
    if name not in CODECS:
        raise SchemaError(f"{where}unknown codec {spec!r}; expected one of 'jpeg', 'jpeg:Q' (quality "
                          "1-100), 'png', 'zstd', 'zstd:L' (level 1-22)")
    value = None
    if param:
        limits = {"jpeg": (1, 100), "zstd": (1, 22)}.get(name)
        try:
            value = int(param)
        except ValueError:
            value = None
        if limits is None or value is None or not limits[0] <= value <= limits[1]:
            raise SchemaError(f"{where}codec {spec!r} has parameter {param!r}; "
                              + (f"expected an integer in [{limits[0]}, {limits[1]}]" if limits else
                                 f"{name!r} takes none"))
    if name in ("jpeg", "png"):
        channels = (1, 3) if name == "jpeg" else (1, 3, 4)
        if dtype != "uint8" or len(shape) != 3 or shape[2] not in channels:
            raise SchemaError(f"{where}codec {name!r} stores uint8 images of shape (H, W, C) with C in "
                              f"{channels}; the field is {dtype} {shape}. Declare ab.Field('uint8', (H, W, C), "
                              f"codec={spec!r}), or use codec='zstd' (lossless, any dtype and shape)")
    elif not shape:
        raise SchemaError(f"{where}codec {spec!r} on a scalar field saves nothing; use no codec")
    kind = {"jpeg": Jpeg, "png": Png, "zstd": Zstd}[name]
    try:
        return kind(spec, dtype, shape, value) if value is not None else kind(spec, dtype, shape)
    except ImportError as err:
        raise SchemaError(f"{where}codec {spec!r} needs {err.name}; pip install 'arrowbuf[images]'") from None


def encode_rows(codec: Codec, rows: np.ndarray | Sequence[np.ndarray]) -> list[bytes]:
    """Each of ``rows`` encoded, in parallel (`map_rows`)."""
    out: list[bytes] = [b""] * len(rows)

    def work(i: int) -> None:
        out[i] = codec.encode(rows[i])

    map_rows(work, len(rows), len(rows) * codec.row_bytes)
    return out
