"""IMAGES' contenders: arrowbuf stores of camera frames (encoded or raw), the ideal decoder,
and TorchRL's `CompressedListStorage`.

- `FrameStore`: ``ExperienceStore`` whose ``obs`` is ``Field("uint8", (224, 224, 3),
  observation=True, codec=...)`` (or no codec: the raw store), with small action, reward
  and terminated fields; whole episodes in (``add_episode``), ``sample(B)`` out.
- `IdealDecoder`: the floor of decoding a batch: the same JPEG byte strings the store
  holds, in a Python list, decoded by ``simplejpeg.decode_jpeg(data, buffer=out[i])``
  (libjpeg-turbo) into a preallocated, pre-touched output on a 2-thread
  ``ThreadPoolExecutor``, one contiguous half of the batch a thread. torchvision's
  ``decode_jpeg`` would be the other floor; it cannot be installed beside torch 2.13 here.
- `TorchRLCompressed`: ``ReplayBuffer(CompressedListStorage(n), RandomSampler())`` of
  transitions, sampled and made contiguous (its sample is a lazy stack of per-row
  TensorDicts). Its storage compresses only a TensorDict's top-level tensors: a nested
  ``("next", "obs")`` would be kept raw, so a transition holds ``obs`` and ``next_obs``
  side by side, each compressed (two frames a transition). ``"zlib"``: its default
  compression (zlib level 3 on Python < 3.14); ``"jpeg:90"``: ``compression_fn`` /
  ``decompression_fn`` of simplejpeg with arrowbuf's settings (quality 90, 4:2:0), the
  codec-for-codec peer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .camera import Footage

FIELDS = ("obs", "action", "reward", "terminated")


class FrameStore:
    """An arrowbuf store of the footage's episodes, frames stored by ``codec`` (None: raw)."""

    def __init__(self, footage: Footage, capacity: int, codec: str | None) -> None:
        import arrowbuf as ab

        frame = footage.frames[0].shape[1:]
        schema = {"obs": ab.Field("uint8", frame, observation=True, codec=codec), "action": ab.Field("int64"),
                  "reward": ab.Field("float32"), "terminated": ab.Field("bool")}
        self.footage, self.codec = footage, codec
        self.store = ab.ExperienceStore(capacity, seed=0, schema=schema)
        self.source_of: dict[int, int] = {}    # episode id -> the source episode it holds
        self.added = 0

    def lap(self) -> int:
        """Episodes that fill the store once."""
        return -(-self.store.capacity // self.footage.episode_len)

    def add(self) -> None:
        """The next source episode (cycling)."""
        source = self.added % len(self.footage.frames)
        self.source_of[self.store.add_episode(self.footage.episode(source))] = source
        self.added += 1

    def fill(self, episodes: int) -> None:
        for _ in range(episodes):
            self.add()

    def sample(self, batch_size: int, keys: list | None = None) -> Any:
        return self.store.sample(batch_size, keys=keys)

    @property
    def column(self) -> Any:
        """The ``obs`` column of the store's one shard (an `arrowbuf.encoded.EncodedColumn` for a
        codec): arrowbuf has no public count of a column's bytes, so the bench reads the shard's."""
        return self.store._backend.engine.shard.arena["obs"]

    def rows_held(self) -> int:
        """Rows of frames held: each episode's T transitions and its final observation."""
        return len(self.store) + self.store.num_episodes

    def frame_bytes(self) -> int:
        """Bytes the held frames take as stored: the encoded bytes (``heap.live``), or raw rows."""
        column = self.column
        if self.codec is None:
            return self.rows_held() * int(np.prod(column.shape[1:]))
        return int(column.heap.live)

    def originals(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        """The written frames of a batch's ``obs`` and ``("next", "obs")``, by episode id and step."""
        episodes, steps = batch["episode_id"].numpy(), batch["step"].numpy()
        frames = self.footage.frames
        obs = np.stack([frames[self.source_of[e]][s] for e, s in zip(episodes.tolist(), steps.tolist())])
        nxt = np.stack([frames[self.source_of[e]][s + 1] for e, s in zip(episodes.tolist(), steps.tolist())])
        return obs, nxt


class IdealDecoder:
    """The store's JPEG rows as a list of bytes, a batch decoded on ``threads`` threads into one
    preallocated output (reused by every call)."""

    def __init__(self, frames: FrameStore, batch_size: int, threads: int = 2) -> None:
        import simplejpeg

        table = frames.store.to_arrow()
        self._decode = simplejpeg.decode_jpeg
        self.blobs: list[bytes] = table["obs"].to_pylist()
        self.starts = np.flatnonzero(~table["is_last"].to_numpy(zero_copy_only=False))   # rows with a next row
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ideal-decode")
        self.out = np.empty((2 * batch_size, *frames.footage.frames[0].shape[1:]), np.uint8)
        self.out[...] = 0   # pre-touch
        self.rng = np.random.default_rng(0)

    def _run(self, blobs: list[bytes], lo: int, hi: int) -> None:
        decode, out = self._decode, self.out
        for i in range(lo, hi):
            decode(blobs[i], colorspace="RGB", buffer=out[i])

    def sample(self, batch_size: int, with_next: bool = True) -> np.ndarray:
        """Decode ``batch_size`` random transitions' frames (and their next frames): the store's work."""
        rows = self.starts[self.rng.integers(0, len(self.starts), batch_size)]
        if with_next:
            rows = np.concatenate([rows, rows + 1])
        blobs = [self.blobs[r] for r in rows.tolist()]
        edges = np.linspace(0, len(blobs), self.threads + 1).astype(int).tolist()
        for future in [self.pool.submit(self._run, blobs, lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]:
            future.result()
        return self.out[:len(blobs)]

    def close(self) -> None:
        self.pool.shutdown()


class TorchRLCompressed:
    """``ReplayBuffer(CompressedListStorage(capacity), RandomSampler())`` of the footage's
    transitions (``obs``, ``next_obs``, action, reward, terminated); ``codec``: "zlib" (its
    default) or "jpeg:90" (simplejpeg functions)."""

    def __init__(self, footage: Footage, capacity: int, codec: str) -> None:
        import logging

        import torch
        from tensordict import TensorDict
        from torchrl.data import CompressedListStorage, RandomSampler, ReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)
        self.footage, self.codec, self.capacity = footage, codec, capacity
        functions = {} if codec == "zlib" else _jpeg_functions(int(codec.partition(":")[2] or 90))
        self.storage = CompressedListStorage(capacity, **functions)
        self.rb = ReplayBuffer(storage=self.storage, sampler=RandomSampler())
        T = footage.episode_len
        self.items = []
        for source in range(len(footage.frames)):
            ep = footage.episode(source)
            frames = torch.from_numpy(ep.pop("obs"))
            self.items.append(TensorDict({"obs": frames[:T], "next_obs": frames[1:],
                                          **{k: torch.from_numpy(v) for k, v in ep.items()}}, batch_size=[T]))
        self.added = 0

    def fill(self) -> None:
        """Episodes until the storage holds ``capacity`` transitions."""
        while len(self.rb) < self.capacity:
            self.rb.extend(self.items[self.added % len(self.items)])
            self.added += 1

    def sample(self, batch_size: int) -> Any:
        return self.rb.sample(batch_size).contiguous()

    def transitions(self) -> int:
        return len(self.rb)

    def frame_bytes(self) -> int:
        """Bytes of the stored frames, ``obs`` and ``next_obs`` (its storage's list of compressed rows:
        its own `bytes()` counts the small fields too)."""
        return sum(row["obs"].numel() + row["next_obs"].numel() for row in self.storage._storage if row is not None)


def _jpeg_functions(quality: int) -> dict:
    """``compression_fn`` / ``decompression_fn`` for `CompressedListStorage`: simplejpeg for
    (H, W, 3) uint8 frames, raw bytes for every other tensor."""
    import simplejpeg
    import torch

    def compress(tensor: torch.Tensor) -> torch.Tensor:
        array = tensor.numpy()
        if tensor.dtype == torch.uint8 and tensor.ndim == 3:
            data = simplejpeg.encode_jpeg(np.ascontiguousarray(array), quality=quality, colorsubsampling="420")
        else:
            data = array.tobytes()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def decompress(data: torch.Tensor, metadata: dict) -> torch.Tensor:
        if metadata["dtype"] == torch.uint8 and len(metadata["shape"]) == 3:
            return torch.from_numpy(simplejpeg.decode_jpeg(data.numpy(), colorspace="RGB"))
        return torch.frombuffer(bytearray(data.numpy().tobytes()), dtype=metadata["dtype"]).reshape(metadata["shape"])

    return {"compression_fn": compress, "decompression_fn": decompress}
