"""The torch arena (``storage_device``): columns as torch tensors on a device.

Every test runs on the CPU torch device, which runs the same code as a CUDA one;
those marked ``cuda`` run on a GPU only (``tools/gpu_check.py``) and skip here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arrowbuf as ab
from arrowbuf.arena import TorchShard

from support.compare import assert_same_batches, assert_same_snapshot, snapshot
from support.episodes import EPISODE_SCHEMA, make_episode

def fill(store: ab.ExperienceStore, episodes: int = 12, steps: int = 9) -> ab.ExperienceStore:
    for tag in range(episodes):
        store.add_episode(make_episode(tag, steps - tag % 4, terminated=tag % 3 != 0, truncated=tag % 3 == 0),
                          env_id=f"env-{tag % 2}")
    return store


def assert_same_contents(a: ab.ExperienceStore, b: ab.ExperienceStore) -> None:
    """Same rows and episode table, except when each episode was inserted."""
    before, after = snapshot(a), snapshot(b)
    for state in (before, after):
        state["episodes"] = state["episodes"].drop_columns(["inserted_at"])
    assert_same_snapshot(before, after)


def twins(**kwargs) -> tuple[ab.ExperienceStore, ab.ExperienceStore]:
    """A numpy-arena store and a CPU torch-arena store, same settings and contents."""
    kwargs = {"seed": 5, "schema": EPISODE_SCHEMA, **kwargs}
    sampler = kwargs.pop("sampler", None)
    numpy_store = fill(ab.ExperienceStore(150, sampler=sampler() if sampler else None, **kwargs))
    torch_store = fill(ab.ExperienceStore(150, sampler=sampler() if sampler else None, storage_device="cpu",
                                          **kwargs))
    return numpy_store, torch_store


SAMPLES = {
    "uniform": ({}, {}),
    "n_step": ({}, {"n_step": 3, "gamma": 0.9}),
    "frame_stack": ({}, {"frame_stack": 3}),
    "keys": ({}, {"keys": ["obs", "reward"]}),
    "prioritized": ({"sampler": lambda: ab.PrioritizedSampler(alpha=0.7, beta=0.5)}, {}),
    "sequences": ({"sampler": lambda: ab.SequenceSampler(4, strict=False)}, {}),
    "episodes": ({"sampler": lambda: ab.EpisodeSampler()}, {}),
    "without_replacement": ({"sampler": lambda: ab.WithoutReplacementSampler()}, {}),
}


@pytest.mark.parametrize("case", sorted(SAMPLES))
def test_the_torch_arena_samples_exactly_what_the_numpy_arena_samples(case):
    settings, args = SAMPLES[case]
    numpy_store, torch_store = twins(**settings)
    for _ in range(3):
        assert_same_batches(numpy_store.sample(24, **args), torch_store.sample(24, **args))


def test_columns_are_tensors_on_the_storage_device_and_batches_stay_there():
    store = fill(ab.ExperienceStore(150, seed=0, storage_device="cpu"))
    assert store.storage_device == torch.device("cpu")
    shard = store.engine.shard
    assert isinstance(shard, TorchShard)
    assert all(isinstance(column, torch.Tensor) and column.device.type == "cpu" for column in shard.arena.values())
    assert shard.arena["obs"].dtype == torch.float64 and shard.arena["terminated"].dtype == torch.bool
    assert ab.ExperienceStore(10).storage_device is None


def test_tensor_writes_are_copied_into_the_arena_without_numpy(monkeypatch):
    store = ab.ExperienceStore(100, seed=0, storage_device="cpu")
    episode = {name: torch.from_numpy(value) for name, value in make_episode(4, 6).items()}

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor write went through numpy")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    monkeypatch.setattr(torch.Tensor, "__array__", refuse)
    episode_id = store.add_episode(episode)
    monkeypatch.undo()
    rows = store.episode(episode_id)
    np.testing.assert_array_equal(rows.column("action").to_numpy(), np.r_[make_episode(4, 6)["action"], 0])
    assert store.engine.shard.arena["obs"][:7].tolist() == make_episode(4, 6)["obs"].tolist()


def test_add_episodes_copies_a_batch_of_tensors_into_the_arena_without_numpy(monkeypatch):
    import arrowbuf.stage_arrays
    import arrowbuf.episode_batch

    def refuse(value, *args):
        raise AssertionError(f"a tensor batch went through numpy: {type(value)}")

    write_rows = TorchShard.write_rows

    def only_tensors(shard, name, start, data):
        assert isinstance(data, torch.Tensor), f"{name} reached the arena as {type(data)}"
        write_rows(shard, name, start, data)

    batch = {name: torch.from_numpy(np.stack([make_episode(tag, 6)[name] for tag in range(4)]))
             for name in make_episode(0, 6)}
    reference = ab.ExperienceStore(100, seed=0, schema=EPISODE_SCHEMA)
    reference.add_episodes({name: value.numpy() for name, value in batch.items()}, lengths=[6, 3, 1, 5])
    store = ab.ExperienceStore(100, seed=0, schema=EPISODE_SCHEMA, storage_device="cpu")
    monkeypatch.setattr(arrowbuf.episode_batch, "as_array", refuse)
    monkeypatch.setattr(arrowbuf.stage_arrays, "as_array", refuse)
    monkeypatch.setattr(TorchShard, "write_rows", only_tensors)
    assert store.add_episodes(batch, lengths=[6, 3, 1, 5]) == [0, 1, 2, 3]
    monkeypatch.undo()
    assert_same_contents(reference, store)


def test_bfloat16_stays_bfloat16_in_the_arena_batches_views_and_checkpoints(tmp_path):
    store = ab.ExperienceStore(100, seed=0, storage_device="cpu")
    obs = torch.randn(6, 3).to(torch.bfloat16)
    store.add_episode({"obs": obs, "action": torch.zeros(5), "terminated": torch.arange(5) == 4})
    assert store.engine.shard.arena["obs"].dtype == torch.bfloat16
    batch = store.sample(16)
    assert batch["obs"].dtype == torch.bfloat16
    assert torch.equal(batch["obs"], obs[batch["step"].long()])
    bits = np.stack(store.episode(0).column("obs").to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(bits, obs.view(torch.int16).numpy().view(np.uint16))
    # saved as uint16 bits on the host, restored as the same bf16 values on the device
    loaded = ab.ExperienceStore.load(store.save(tmp_path / "ckpt"))
    assert torch.equal(loaded.engine.shard.arena["obs"][:6], obs)


def test_writers_fill_a_torch_arena_as_they_fill_a_numpy_one():
    numpy_store, torch_store = (ab.ExperienceStore(200, seed=1, storage_device=d) for d in (None, "cpu"))
    for store in (numpy_store, torch_store):
        writer = store.writer(num_envs=3, autoreset_mode="disabled")
        obs = np.zeros((3, 2), np.float32)
        for t in range(7):
            done = np.arange(3) == t % 3
            writer.add(obs=obs + t, action=np.full(3, t), reward=np.ones(3, np.float32), terminated=done,
                       truncated=np.zeros(3, bool), next_obs=obs + t + 1)
        writer.flush()
    assert_same_contents(numpy_store, torch_store)


def run_writer(writer, steps: range) -> None:
    """Tensor steps of 3 envs (the first ending every 3rd step)."""
    for t in steps:
        writer.add(obs=torch.full((3, 2), t, dtype=torch.bfloat16), action=torch.full((3,), t, dtype=torch.int32),
                   reward=torch.ones(3), terminated=torch.arange(3) == t % 3, truncated=torch.zeros(3, dtype=torch.bool),
                   next_obs=torch.full((3, 2), t + 1, dtype=torch.bfloat16))


def test_a_torch_arena_writer_stages_tensors_on_the_device_without_numpy(monkeypatch, tmp_path):
    import arrowbuf.stage_arrays
    import arrowbuf.step_reading

    def refuse(value, *args):
        raise AssertionError(f"a tensor step went through numpy: {type(value)}")

    reference = ab.ExperienceStore(200, seed=1, storage_device="cpu")
    writer = reference.writer(num_envs=3, autoreset_mode="disabled")
    run_writer(writer, range(10))
    writer.flush()
    store = ab.ExperienceStore(200, seed=1, storage_device="cpu")
    writer = store.writer(num_envs=3, autoreset_mode="disabled", name="runner")
    monkeypatch.setattr(arrowbuf.step_reading, "as_array", refuse)   # where a writer reads a step
    monkeypatch.setattr(arrowbuf.stage_arrays, "as_array", refuse)
    write_rows = TorchShard.write_rows

    def only_tensors(shard, name, start, data):
        assert isinstance(data, torch.Tensor), f"{name} reached the arena as {type(data)}"
        write_rows(shard, name, start, data)

    monkeypatch.setattr(TorchShard, "write_rows", only_tensors)
    run_writer(writer, range(6))
    monkeypatch.undo()
    # open episodes staged on the device survive a checkpoint (saved as host copies)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    restored = loaded.writer(num_envs=3, autoreset_mode="disabled", name="runner")
    for target, w in ((store, writer), (loaded, restored)):
        run_writer(w, range(6, 10))
        w.flush()
        assert_same_contents(reference, target)


def test_a_checkpoint_of_a_torch_arena_loads_back_on_its_device_and_samples_the_same(tmp_path):
    _, store = twins(sampler=lambda: ab.PrioritizedSampler(alpha=0.6, beta=0.4))
    batch = store.sample(8)
    store.update_priorities(batch["index"], torch.arange(8, dtype=torch.float64) + 1)
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert isinstance(loaded.engine.shard, TorchShard) and loaded.storage_device == torch.device("cpu")
    on_host = ab.ExperienceStore.load(tmp_path / "ckpt", storage_device=None)
    assert on_host.storage_device is None and not isinstance(on_host.engine.shard, TorchShard)
    assert_same_snapshot(snapshot(store), snapshot(loaded))
    for _ in range(3):
        expected = store.sample(16)
        assert_same_batches(expected, loaded.sample(16))
        assert_same_batches(expected, on_host.sample(16))
    with pytest.raises(ValueError, match="storage_device must be None"):
        ab.ExperienceStore.load(tmp_path / "ckpt", storage_device="meta")


def test_parquet_exports_of_a_torch_arena_import_into_either_arena(tmp_path):
    numpy_store, torch_store = twins()
    torch_store.to_parquet(tmp_path / "export")
    for device in (None, "cpu"):
        imported = ab.ExperienceStore.from_parquet(tmp_path / "export", storage_device=device)
        assert imported.storage_device == (torch.device(device) if device else None)
        assert_same_contents(numpy_store, imported)


def test_inspect_and_episode_views_read_a_torch_arena_as_a_numpy_one(tmp_path):
    from arrowbuf.inspect import summarize

    numpy_store, torch_store = twins()
    assert summarize(torch_store) == summarize(numpy_store)
    for episode_id in numpy_store.episodes().column("episode_id").to_pylist():
        assert torch_store.episode(episode_id).equals(numpy_store.episode(episode_id))
    torch_store.save(tmp_path / "ckpt")
    assert summarize(tmp_path / "ckpt")["kind"] == "checkpoint"


def test_compute_gae_writes_the_same_advantages_on_both_arenas():
    stores = []
    for device in (None, "cpu"):
        store = ab.ExperienceStore(200, seed=2, storage_device=device)
        for k in range(5):
            steps = 4 + k
            store.add_episode({"obs": np.full((steps + 1, 2), k, np.float32), "reward": np.ones(steps, np.float32),
                               "value": np.linspace(0, 1, steps, dtype=np.float32),
                               "terminated": np.arange(steps) == steps - 1 if k % 2 else np.zeros(steps, bool),
                               "truncated": np.zeros(steps, bool)})
        assert store.compute_gae(0.9, 0.8, bootstrap_value=lambda obs: obs["obs"][:, 0].double()) == len(store)
        stores.append(store)
    assert_same_contents(stores[0], stores[1])
    assert isinstance(stores[1].engine.shard.arena["advantage"], torch.Tensor)


def test_a_bad_tensor_episode_or_step_is_refused_naming_the_field_and_changes_nothing():
    store = fill(ab.ExperienceStore(150, seed=0, schema=EPISODE_SCHEMA, storage_device="cpu"))
    before = snapshot(store)
    good = {name: torch.from_numpy(value) for name, value in make_episode(1, 5).items()}
    with pytest.raises(ab.SchemaError, match=r"field 'obs': per-step shape \(1,\)"):
        store.add_episode({**good, "obs": good["obs"][:, :1]})
    with pytest.raises(ab.SchemaError, match="field 'action': dtype float32; expected int64"):
        store.add_episode({**good, "action": good["action"].float()})
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    with pytest.raises(ab.SchemaError, match="field 'reward'"):
        writer.add(obs=torch.zeros(2, 2, dtype=torch.float64), action=torch.zeros(2, dtype=torch.int64),
                   reward=torch.zeros(2, 3, dtype=torch.float64), terminated=torch.ones(2, dtype=torch.bool),
                   truncated=torch.zeros(2, dtype=torch.bool), next_obs=torch.zeros(2, 2, dtype=torch.float64))
    assert writer.open_steps.tolist() == [0, 0]
    assert_same_snapshot(before, snapshot(store))


@pytest.mark.parametrize("device, message", [
    ("tpu", "storage_device: device must be a torch.device"),
    ("meta", "storage_device must be None"),
    (3.5, "storage_device: device must be a torch.device"),
] + ([] if torch.cuda.is_available() else [("cuda", "storage_device: device 'cuda': this process sees no CUDA")]))
def test_a_bad_storage_device_is_refused_naming_the_value(device, message):
    with pytest.raises(ValueError, match=message):
        ab.ExperienceStore(10, storage_device=device)


def test_a_cuda_arena_larger_than_the_device_s_free_memory_is_refused_before_allocating(monkeypatch):
    # The check runs before any CUDA call, so a faked free-memory reading tests it without a GPU.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 20, 1 << 30))
    schema = ab.Schema({"obs": ab.Field("float32", (256,), observation=True), "terminated": ab.Field("bool")})
    # 1 MiB holds 1,023 rows: an arena of capacity + capacity // 8 + 64 rows (`arena_rows`) up to capacity 853.
    with pytest.raises(ab.ResourceError, match=r"storage_device='cuda': capacity=10,000 transitions take 11,314 rows "
                                               r"of 1,025 bytes, which need 0.01 GiB, but the device has 0.00 GiB "
                                               r"free; use capacity <= 853$"):
        TorchShard(schema, 10_000, device=torch.device("cuda"))


def test_a_ray_store_refuses_a_storage_device_and_says_why():
    # Checked before any shard starts: no Ray session needed.
    with pytest.raises(ValueError, match="needs backend='local': a Ray store's shards publish their rows"):
        ab.ExperienceStore(10, backend="ray", storage_device="cpu")


def _cuda_store() -> ab.ExperienceStore:
    store = ab.ExperienceStore(1_000, seed=0, storage_device="cuda")
    for tag in range(8):
        episode = {name: torch.from_numpy(value).cuda() for name, value in make_episode(tag, 20).items()}
        episode["pixels"] = torch.full((21, 4, 4), tag, dtype=torch.bfloat16, device="cuda")
        store.add_episode(episode)
    return store


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_arena_takes_device_tensors_and_samples_on_the_device():
    store = _cuda_store()
    assert all(column.is_cuda for column in store.engine.shard.arena.values())
    batch = store.sample(64)
    assert batch.device.type == "cuda" and batch["pixels"].dtype == torch.bfloat16
    assert torch.equal(batch["pixels"][:, 0, 0].float(), batch["obs"][:, 0].float())
    assert store.sample(8, device="cpu")["obs"].device.type == "cpu"
    first = next(iter(store.iter_batches(5, shuffle=False)))
    column = store.engine.shard.arena["action"]
    assert column.data_ptr() <= first["action"].data_ptr() < column.data_ptr() + column.nbytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_arena_exports_and_checkpoints_through_the_host(tmp_path):
    store = _cuda_store()
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert loaded.storage_device.type == "cuda"
    assert_same_snapshot(snapshot(store), snapshot(loaded))
    assert_same_batches(store.sample(32).cpu(), loaded.sample(32).cpu())
    store.to_parquet(tmp_path / "export")
    assert_same_contents(store, ab.ExperienceStore.from_parquet(tmp_path / "export"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_arena_runs_writers_epochs_gae_and_prioritized_sampling_like_the_cpu_one():
    stores = []
    for device in ("cpu", "cuda"):
        store = ab.ExperienceStore(500, seed=3, storage_device=device,
                                   sampler=ab.PrioritizedSampler(alpha=0.6, beta=0.4))
        writer = store.writer(num_envs=3, autoreset_mode="disabled")
        for t in range(12):
            writer.add(obs=torch.full((3, 2), t, dtype=torch.bfloat16, device=device),
                       action=torch.full((3,), t, device=device), reward=torch.ones(3, device=device),
                       value=torch.full((3,), 0.5, device=device), terminated=torch.arange(3, device=device) == t % 3,
                       truncated=torch.zeros(3, dtype=torch.bool, device=device),
                       next_obs=torch.full((3, 2), t + 1, dtype=torch.bfloat16, device=device))
        writer.flush()
        store.compute_gae(0.9, 0.9, bootstrap_value=lambda obs: obs["obs"][:, 0].float())
        batch = store.sample(16)
        store.update_priorities(batch["index"], batch["advantage"].abs())
        stores.append(store)
    cpu, cuda = stores
    assert_same_contents(cpu, cuda)
    assert_same_batches(cpu.sample(32), cuda.sample(32).cpu())
    epochs = [[b.cpu() for b in store.iter_batches(7, epochs=2)] for store in stores]
    for a, b in zip(*epochs):
        assert_same_batches(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_isaaclab_sized_rollout_of_cuda_tensors_is_written_in_place_as_the_cpu_arena_writes_it():
    """4,096 envs hand over CUDA tensors each step (IsaacLab); the cuda arena stores what the cpu arena does."""
    envs, steps = 4_096, 24
    generator = torch.Generator().manual_seed(0)
    obs = torch.randn(steps + 1, envs, 8, generator=generator).to(torch.bfloat16)
    action = torch.randn(steps, envs, 3, generator=generator)
    reward = torch.randn(steps, envs, generator=generator)
    done = torch.rand(steps, envs, generator=generator) < 0.05
    stores = []
    for device in ("cpu", "cuda"):
        store = ab.ExperienceStore(2 * envs * steps, seed=5, storage_device=device)
        writer = store.writer(num_envs=envs, autoreset_mode="disabled")
        for t in range(steps):
            writer.add(obs=obs[t].to(device), action=action[t].to(device), reward=reward[t].to(device),
                       terminated=done[t].to(device), truncated=torch.zeros(envs, dtype=torch.bool, device=device),
                       next_obs=obs[t + 1].to(device))
        assert len(store) == envs * steps        # every completed step is sampleable before any flush
        writer.flush()
        stores.append(store)
    cpu, cuda = stores
    assert all(column.is_cuda for column in cuda.engine.shard.arena.values())
    assert_same_contents(cpu, cuda)
    assert_same_batches(cpu.sample(512), cuda.sample(512).cpu())
    assert_same_batches(cpu.sample(256, device="cuda").cpu(), cuda.sample(256).cpu())
