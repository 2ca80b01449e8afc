"""arrowbuf.compat.placement: shards, backend, train workers and node affinity from RLightning's inputs."""

from __future__ import annotations

import pytest

from arrowbuf.compat import DataBuffer, parse_config
from arrowbuf.compat.placement import resolve_placement


def settings(**storage):
    return parse_config({"type": "RolloutBuffer", "capacity": 10, "storage": storage})


def affinity_settings(env=True, train=True, **storage):
    return parse_config({"type": "RolloutBuffer", "capacity": 10, "storage": storage,
                         "node_affinity_env": env, "node_affinity_train": train})


def test_the_cluster_section_places_unified_and_sharded_storage_as_the_seed():
    cluster = {"remote_storage": True, "buffer_worker_num": 2, "train_worker_num": 4, "train_each_gpu_num": 1.0}
    unified = resolve_placement(settings(), cluster)
    assert (unified.backend, unified.num_shards, unified.num_train_workers) == ("ray", 1, 4)
    sharded = resolve_placement(settings(type="sharded"), cluster)
    assert (sharded.backend, sharded.num_shards, sharded.num_train_workers) == ("ray", 2, 4)
    assert resolve_placement(settings(type="sharded", num_shards=3), cluster).num_shards == 3
    local = resolve_placement(settings(), {"remote_storage": False, "train_worker_num": 2})
    assert (local.backend, local.num_shards, local.num_train_workers) == ("local", 1, 2)


def test_without_a_cluster_section_the_remote_storage_flag_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLIGHTNING_REMOTE_STORAGE", "1")
    assert resolve_placement(settings()).backend == "ray"
    monkeypatch.setenv("RLIGHTNING_REMOTE_STORAGE", "0")
    placement = resolve_placement(settings())
    assert (placement.backend, placement.num_train_workers) == ("local", 1)
    assert resolve_placement(settings(), num_train_workers=3).num_train_workers == 3


def test_auto_buffer_workers_count_the_nodes_that_hold_train_workers():
    distribution = {"n1": {"buffer": {"ids": [0]}, "train": {"ids": [0, 1]}, "env": {"ids": [0]}},
                    "n2": {"buffer": {"ids": [1]}, "train": {"ids": [2, 3]}, "env": {"ids": [1]}},
                    "n3": {"env": {"ids": [2]}}}
    placement = resolve_placement(settings(type="sharded"), {"buffer_worker_num": "auto", "train_worker_num": 4},
                                  component_distribution=distribution)
    assert placement.num_shards == 2


def test_node_affinity_maps_env_workers_and_train_workers_to_the_shards_on_their_nodes():
    distribution = {"n1": {"buffer": {"ids": [0]}, "train": {"ids": [0, 1]}, "env": {"ids": [0, 2]}},
                    "n2": {"buffer": {"ids": [1]}, "train": {"ids": [2, 3]}, "env": {"ids": [1, 3]}}}
    placement = resolve_placement(affinity_settings(type="sharded"), {"buffer_worker_num": 2, "train_worker_num": 4},
                                  component_distribution=distribution)
    assert placement.shard_nodes == ("n1", "n2")
    assert [placement.shard_of_env(f"9c1e-{k}") for k in range(4)] == [0, 1, 0, 1]
    assert placement.shard_of_env("9c1e-3/17") == 1            # a sub-env goes where its worker goes
    assert placement.worker_shards == ((0,), (0,), (1,), (1,))
    with pytest.raises(ValueError, match="env id '9c1e-7' does not end in '-<env worker index>' of a known env"):
        placement.shard_of_env("9c1e-7")


def test_a_one_node_cluster_maps_like_the_seed_without_a_component_distribution():
    placement = resolve_placement(affinity_settings(type="sharded"), {"buffer_worker_num": 2, "train_worker_num": 2},
                                  driver_node="node-a")
    assert placement.worker_shards == ((0,), (1,))              # contiguous blocks, as the seed's table
    assert [placement.shard_of_env(f"u-{k}") for k in range(3)] == [0, 1, 0]


@pytest.mark.parametrize("cluster, kwargs, message", [
    ({"remote_storage": False, "buffer_worker_num": 2}, {}, "'sharded', which needs remote storage"),
    ({"buffer_worker_num": 0}, {}, "cluster config 'buffer_worker_num': got 0, expected an int >= 1 or 'auto'"),
    ({"remote_storage": "yes"}, {}, "cluster config 'remote_storage': got 'yes', expected true or false"),
    ({"train_worker_num": 1.5}, {}, "cluster config 'train_worker_num': got 1.5, expected an int >= 1"),
    (None, {"backend": "local"}, "'sharded', which needs remote storage"),
])
def test_bad_placement_inputs_are_refused_naming_the_key_and_value(cluster, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_placement(settings(type="sharded"), cluster, **kwargs)


def test_a_distribution_that_leaves_a_shard_without_a_node_is_refused():
    with pytest.raises(ValueError, match=r"places no node for buffer shard\(s\) \[1\]"):
        resolve_placement(affinity_settings(type="sharded"), {"buffer_worker_num": 2, "train_worker_num": 2},
                          component_distribution={"n1": {"buffer": {"ids": [0]}, "train": {"ids": [0, 1]}}})


def test_a_data_buffer_reads_its_train_worker_count_from_the_cluster_section():
    buffer = DataBuffer({"type": "ReplayBuffer", "capacity": 10},
                        cluster={"remote_storage": False, "train_worker_num": 3})
    assert buffer.num_train_workers == 3 and buffer.backend == "local"
