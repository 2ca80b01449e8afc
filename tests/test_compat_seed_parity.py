"""arrowbuf.compat against the seed's semantics where hostile testing found gaps (issue 26, D9):
an empty gather on a sharded Ray store, the capacity of a circular buffer, an unknown
``cluster`` key, and every buffer / cluster config RLightning's examples ship."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.compat import ClusterKeyWarning, ReplayBuffer, parse_config
from arrowbuf.compat.placement import CLUSTER_KEYS, resolve_placement

ROOT = Path(__file__).resolve().parents[1]


def episode(steps: int, tag: int) -> dict:
    return {"observation": np.full((steps + 1, 2), tag, np.float32), "action": np.arange(steps, dtype=np.int64),
            "reward": np.full(steps, tag, np.float32), "terminated": np.zeros(steps, bool),
            "truncated": np.zeros(steps, bool)}


def layout(batch) -> dict:
    return {key: (value.dtype, tuple(value.shape)) for key, value in batch.items(include_nested=True, leaves_only=True)}


@pytest.mark.usefixtures("ray_session")
def test_an_empty_gather_on_a_two_shard_ray_store_returns_every_field_as_the_local_store_does():
    local = ab.ExperienceStore(100, seed=0)
    remote = ab.ExperienceStore(100, backend="ray", num_shards=2, seed=0)
    try:
        for store in (local, remote):
            for k in range(4):
                store.add_episode(episode(3 + k, k), env_id=f"env-{k}")
            store.flush()
        expected = layout(local.gather(np.zeros(0, np.int64)))
        assert ("next", "observation") in expected and "action" in expected
        got = remote.gather(np.zeros(0, np.int64))
        assert got.batch_size == (0,) and layout(got) == expected
        # and through compat, on sharded storage
        buffer = ReplayBuffer({"capacity": 100, "storage": {"type": "sharded", "num_shards": 2}}, seed=0)
        for k in range(4):
            buffer.add_episode(episode(3 + k, k))
        assert layout(buffer.store.gather(np.zeros(0, np.int64))) == expected
        assert set(buffer[[]].keys()) >= {"observation", "next_observation", "action", "reward"}
        buffer.store.close()
    finally:
        remote.close()


@pytest.mark.parametrize("unit", ["transition", "episode"])
def test_a_circular_buffer_never_holds_more_transitions_than_its_capacity_and_keeps_the_newest(unit):
    buffer = ReplayBuffer({"capacity": 400, "storage": {"unit": unit}}, seed=0)
    lengths = [45 if k % 2 else 27 for k in range(60)]
    for k, steps in enumerate(lengths):
        buffer.add_episode(episode(steps, k))
        held = buffer[:]
        transitions = int(held["mask"].sum()) if unit == "episode" else held.batch_size[0]
        assert transitions <= 400, (k, transitions)                         # main held 405 here
        assert (len(buffer) if unit == "transition" else transitions) <= 400
        tags = held["reward"][held["mask"]] if unit == "episode" else held["reward"]
        newest = set(range(k, -1, -1)[:len(set(tags.tolist()))])
        assert set(tags.tolist()) == newest                                 # the oldest go first
    sampled = buffer.sample(256 if unit == "transition" else 8)[0]
    rewards = sampled["reward"][sampled["mask"]] if unit == "episode" else sampled["reward"]
    assert int(rewards.min()) >= 60 - 400 // 27                     # never a hidden (older) transition


def test_a_misspelt_cluster_key_warns_naming_it_and_the_known_keys_and_is_ignored_as_the_seed_ignores_it():
    settings = parse_config({"type": "ReplayBuffer", "capacity": 10})
    with pytest.warns(ClusterKeyWarning, match=r"unknown key 'remote_storge' \(value False\) is ignored \(did you "
                      r"mean 'remote_storage'\?\); remote_storage keeps its default; known keys: ray_address, "):
        placement = resolve_placement(settings, {"remote_storge": False, "train_worker_num": 1}, backend="local",
                                      driver_node="n0")
    assert placement.backend == "local"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_placement(settings, {"ray_address": "auto", "remote_storage": False}, driver_node="n0")


def seed_checkout() -> Path | None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench import real_seed
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return real_seed.locate()[0]


def test_every_buffer_and_cluster_config_rlightnings_examples_ship_loads():
    import yaml   # (Ray's dependency)

    repo = seed_checkout()
    if repo is None:
        pytest.skip("no RLightning checkout: run `python tools/seed_checkout.py` (or set ARROWBUF_SEED_REPO)")
    examples = repo / "examples"
    buffers = sorted(examples.glob("*/conf/buffer/*.yaml"))
    clusters = sorted(examples.glob("*/conf/cluster/*.yaml"))
    tops = [(path, yaml.safe_load(path.read_text())) for path in sorted(examples.glob("*/conf/*.yaml"))]
    assert len(buffers) >= 7 and len(clusters) >= 8
    warned = []
    for path in buffers:
        base = yaml.safe_load(path.read_text())
        if base is None:   # algorithm_template's buffer.yaml: comments only (the seed's BufferConfig refuses it too)
            assert path.parts[-4] == "algorithm_template"
            continue
        variants = [base] + [{**base, **top["buffer"], "storage": {**(base.get("storage") or {}),
                                                                   **(top["buffer"].get("storage") or {})}}
                             for top_path, top in tops if isinstance(top, dict) and isinstance(top.get("buffer"), dict)
                             and top_path.parents[1] == path.parents[2]]
        for config in variants:
            settings = parse_config(config)
            assert settings.capacity >= 1
    settings = parse_config({"type": "ReplayBuffer", "capacity": 10})
    sections = [(path, yaml.safe_load(path.read_text())) for path in clusters]
    sections += [(path, top["cluster"]) for path, top in tops
                 if isinstance(top, dict) and isinstance(top.get("cluster"), dict)]
    for path, section in sections:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resolve_placement(settings, section, backend="local", driver_node="n0")
        warned += [(path.name, str(w.message).split("'")[1]) for w in caught if w.category is ClusterKeyWarning]
    assert warned == [("1train_1eval.yaml", "remote_storge")]   # the one misspelt key; CLUSTER_KEYS has the rest
    assert "remote_storage" in CLUSTER_KEYS


def test_a_compat_draw_of_nothing_has_every_field_of_a_store_with_sequences_and_text():
    """compat's empty batch is the store's (`arrowbuf.tensors.empty_batch`) in the seed's keys: its own
    copy made ``torch.zeros((0, None))`` for a ragged field (TypeError) and a tensor for a text one."""
    from arrowbuf.compat.reading import empty_batch

    schema = ab.Schema({"obs": ab.Field("float32", (3,), observation=True), "tokens": ab.Field("int32", (None,)),
                        "instruction": ab.Field("string", ())})
    batch = empty_batch(schema, None)
    assert set(batch.keys()) == {"obs", "next_obs", "tokens", "instruction", "index", "episode_id", "step"}
    assert batch.batch_size == (0,) and batch["obs"].shape == (0, 3) and batch["tokens"].is_nested
