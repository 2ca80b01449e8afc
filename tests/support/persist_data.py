"""The stores the Parquet export and checkpoint tests round-trip, and a checkpoint editor.

Three kinds of data: ``w1`` (MuJoCo-like: obs float32[17], action float32[6]),
``pixels`` (obs uint8[16, 16, 3]) and ``nested`` (a dict observation with a
bfloat16 field, a bfloat16 action and a bool[4] field). Episodes have random lengths; every third one has no final
observation, and a few carry metadata. Stores are small enough to wrap their ring.
The round trips compare with `support.compare`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

import arrowbuf as ab
from arrowbuf import _persist, checkpoint

KINDS = ("w1", "pixels", "nested")


def schema_of(kind: str) -> ab.Schema:
    flags = {"reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}
    if kind == "w1":
        return ab.Schema({"obs": ab.Field("float32", (17,), True), "action": ab.Field("float32", (6,)), **flags})
    if kind == "pixels":
        return ab.Schema({"obs": ab.Field("uint8", (16, 16, 3), True), "action": ab.Field("int64"), **flags})
    return ab.Schema({"obs": {"state": ab.Field("bfloat16", (5,), True), "pixels": ab.Field("uint8", (8, 8, 3), True)},
                      "action": ab.Field("bfloat16", (2,)), "log_prob": ab.Field("float64"),
                      "contacts": ab.Field("bool", (4,)), **flags})


def episode_of(kind: str, rng: np.random.Generator, steps: int, has_final: bool) -> dict[str, Any]:
    """One random episode of ``kind`` (observations with T+1 rows when ``has_final``)."""
    rows = steps + int(has_final)
    end = np.arange(steps) == steps - 1
    truncated = bool(rng.integers(2))
    data: dict[str, Any] = {"reward": rng.standard_normal(steps).astype(np.float32),
                            "terminated": end & (not truncated), "truncated": end & truncated}
    if kind == "w1":
        data["obs"] = rng.standard_normal((rows, 17)).astype(np.float32)
        data["action"] = rng.uniform(-1, 1, (steps, 6)).astype(np.float32)
    elif kind == "pixels":
        data["obs"] = rng.integers(0, 256, (rows, 16, 16, 3), dtype=np.uint8)
        data["action"] = rng.integers(0, 18, steps)
    else:
        state = torch.from_numpy(rng.standard_normal((rows, 5)).astype(np.float32)).to(torch.bfloat16)
        data["obs"] = {"state": state, "pixels": rng.integers(0, 256, (rows, 8, 8, 3), dtype=np.uint8)}
        data["action"] = torch.from_numpy(rng.standard_normal((steps, 2)).astype(np.float32)).to(torch.bfloat16)
        data["log_prob"] = rng.standard_normal(steps)
        data["contacts"] = rng.integers(0, 2, (steps, 4)).astype(bool)
    return data


def fill(store: ab.ExperienceStore, kind: str, episodes: int, seed: int = 0, first: int = 0) -> None:
    """Add ``episodes`` random episodes of 3..14 steps (numbered from ``first``)."""
    rng = np.random.default_rng(seed)
    for k in range(first, first + episodes):
        steps = int(rng.integers(3, 15))
        store.add_episode(episode_of(kind, rng, steps, has_final=k % 3 != 2), env_id=f"env-{k % 4}",
                          metadata={"k": k} if k % 5 == 0 else None)


def wrapped_store(kind: str = "w1", *, capacity: int = 150, episodes: int = 40, seed: int = 0,
                  sampler: ab.Sampler | None = None, **kwargs: Any) -> ab.ExperienceStore:
    """A store that has wrapped its ring and evicted its oldest episodes."""
    store = ab.ExperienceStore(capacity=capacity, seed=seed, schema=schema_of(kind), sampler=sampler, **kwargs)
    fill(store, kind, episodes, seed)
    added = episodes
    while np.all(np.diff(store.episodes()["first_row"].to_numpy()) > 0) and added < 4 * episodes:
        fill(store, kind, 1, seed + added, first=added)   # the ring grows while its front is too short: go on
        added += 1
    table = store.episodes()
    assert table["episode_id"][0].as_py() > 0, "expected evictions"
    assert not np.all(np.diff(table["first_row"].to_numpy()) > 0), "expected a wrapped ring"
    return store


def edit_checkpoint(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change a checkpoint's state as a deliberate editor would: ``edit`` mutates the
    state (arrays joined in); the state file and the manifest are rewritten with
    matching hashes, so only the checks of the state's domains can catch it."""
    manifest_path = path / checkpoint.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    state_file = path / manifest["state_file"]["path"]
    state = _persist.join_arrays(manifest["state"], _persist.table_arrays(pa.ipc.open_file(
        pa.memory_map(str(state_file))).read_all()))
    edit(state)
    tree, arrays = _persist.split_arrays(state)
    table = _persist.arrays_table(arrays)
    _persist.write_ipc(state_file, table.schema, table.to_batches())
    manifest["state"] = tree
    manifest["state_file"] = {"path": state_file.name, **_persist.file_entry(state_file)}
    _persist.write_manifest(manifest_path, manifest)
