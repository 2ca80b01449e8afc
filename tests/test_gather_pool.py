"""Field selection and the pool of reused gather buffers (`Gather`, `_pool.SlotPool`)."""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf._pool import SlotPool, SlotSpec
from arrowbuf.tensors import Gather

from support.episodes import make_episode


SYSTEM = {"index", "episode_id", "step"}


def filled_store(capacity: int = 200) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=capacity, seed=0)
    for tag in range(4):
        store.add_episode(make_episode(tag, 20))
    return store


def keys_of(batch) -> set:
    return set(batch.keys(include_nested=True, leaves_only=True))


def span(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def snapshot(batch) -> dict:
    """(address, copy) of every tensor of a batch."""
    return {key: (batch.get(key).data_ptr(), batch.get(key).clone()) for key in keys_of(batch)}


def assert_unchanged(batch, before: dict) -> None:
    for key, (address, copy) in before.items():
        assert batch.get(key).data_ptr() == address, key
        assert torch.equal(batch.get(key), copy), key


# -- field selection -----------------------------------------------------------------


def test_keys_gather_exactly_the_named_fields_plus_index_episode_id_and_step():
    batch = filled_store().sample(8, keys=["obs", "reward"])
    assert keys_of(batch) == {"obs", "reward"} | SYSTEM


def test_a_next_observation_is_gathered_only_when_named():
    store = filled_store()
    assert keys_of(store.sample(8, keys=["obs"])) == {"obs"} | SYSTEM
    batch = store.sample(8, keys=[("next", "obs")])
    assert keys_of(batch) == {("next", "obs")} | SYSTEM
    # obs of step t is [tag, t]: the next observation holds t + 1
    np.testing.assert_array_equal(batch["next", "obs"][:, 1].numpy(), batch["step"].numpy() + 1)


def test_without_keys_every_field_and_every_next_observation_is_gathered():
    batch = filled_store().sample(8)
    assert keys_of(batch) == {"obs", ("next", "obs"), "action", "reward", "terminated", "truncated"} | SYSTEM


def test_a_key_that_prefixes_others_selects_them_all():
    batch = filled_store().sample(8, keys=["next", "action"])
    assert keys_of(batch) == {("next", "obs"), "action"} | SYSTEM


def test_naming_an_extra_that_is_always_there_is_allowed():
    assert keys_of(filled_store().sample(8, keys=["index", "step"])) == SYSTEM


def test_selected_fields_hold_the_same_values_as_a_full_sample():
    one, other = filled_store(), filled_store()
    full, some = one.sample(16), other.sample(16, keys=["action", ("next", "obs")])
    for key in keys_of(some):
        assert torch.equal(full.get(key), some.get(key)), key


def test_an_unknown_key_raises_naming_it_and_the_available_keys_and_draws_nothing():
    store, twin = filled_store(), filled_store()
    with pytest.raises(ValueError, match=r"'pixels'.*available.*'obs'.*\('next', 'obs'\)"):
        store.sample(8, keys=["obs", "pixels"])
    with pytest.raises(ValueError, match=r"\('next', 'action'\)"):
        store.iter_batches(8, keys=[("next", "action")])
    assert store.stats()["samples"] == 0
    # the generator did not move: the store draws what its untouched twin draws
    assert torch.equal(store.sample(8)["index"], twin.sample(8)["index"])
    assert torch.equal(next(iter(store.iter_batches(8)))["index"], next(iter(twin.iter_batches(8)))["index"])


@pytest.mark.parametrize("keys", ["obs", ("next", "obs"), 3, [3], [()], [("next", 1)]])
def test_keys_that_are_not_a_list_of_keys_are_refused(keys):
    with pytest.raises(ValueError, match="key"):
        filled_store().sample(8, keys=keys)


def test_iter_batches_gathers_only_the_named_keys_of_every_transition():
    store = filled_store()
    batches = list(store.iter_batches(16, shuffle=True, keys=["action"]))
    assert all(keys_of(batch) == {"action"} | SYSTEM for batch in batches)
    assert sorted(torch.cat([b["index"] for b in batches]).tolist()) == list(range(len(store)))


def test_an_n_step_reward_comes_only_with_the_reward_field():
    store = filled_store()
    assert keys_of(store.sample(8, n_step=3, keys=["obs"])) == {"obs", "discount", "n_steps"} | SYSTEM
    assert "reward" in keys_of(store.sample(8, n_step=3, keys=["reward"]))


# -- the pool: kept batches stay, dropped ones are reused ------------------------------


def test_a_dropped_batch_s_buffer_is_reused_by_the_next_sample():
    store = filled_store()
    batch = store.sample(8)
    address = batch["obs"].data_ptr()
    del batch
    assert store.sample(8)["obs"].data_ptr() == address


def test_a_kept_batch_is_never_overwritten_by_later_samples():
    store = filled_store()
    kept = store.sample(8)
    before = snapshot(kept)
    later = [store.sample(8) for _ in range(3)]   # held: each needs a buffer of its own
    for _ in range(20):
        batch = store.sample(8)
        assert not overlaps(span(batch["obs"]), span(kept["obs"]))
    assert_unchanged(kept, before)
    assert len({b["obs"].data_ptr() for b in [kept, *later]}) == 4


@pytest.mark.parametrize("keep", [
    pytest.param(lambda batch: batch["action"], id="a tensor"),
    pytest.param(lambda batch: batch["action"][2:5], id="a slice of one tensor"),
    pytest.param(lambda batch: batch["action"].numpy(), id="a numpy view"),
    pytest.param(lambda batch: batch["action"][2:5].numpy(), id="a numpy view of a slice"),
    pytest.param(lambda batch: batch["next"], id="a nested TensorDict"),
    pytest.param(lambda batch: batch.split(4)[1], id="a split of the batch"),
    pytest.param(lambda batch: batch["action"].detach(), id="a detached tensor"),
])
def test_anything_kept_from_a_batch_keeps_its_buffer_from_being_overwritten(keep):
    store = filled_store()
    batch = store.sample(8)
    kept = keep(batch)
    copy = np.array(kept) if isinstance(kept, np.ndarray) else kept.clone()
    address = batch["action"].data_ptr()
    del batch
    for _ in range(10):
        assert store.sample(8)["action"].data_ptr() != address
    if isinstance(kept, np.ndarray):
        np.testing.assert_array_equal(kept, copy)
    else:
        assert (kept == copy).all()


def test_a_tensor_saved_for_backward_keeps_its_buffer_from_being_overwritten():
    store = filled_store()
    batch = store.sample(8)
    weight = torch.ones(2, dtype=torch.float64, requires_grad=True)
    loss = (batch["obs"] * weight).sum()   # autograd saves batch["obs"] for the weight's gradient
    expected = batch["obs"].sum(0).clone()
    del batch
    for _ in range(10):
        store.sample(8)
    loss.backward()
    assert torch.equal(weight.grad, expected)


def test_a_tensor_the_user_replaced_but_still_holds_is_not_overwritten():
    store = filled_store()
    batch = store.sample(8)
    old = batch["obs"]
    copy = old.clone()
    batch["obs"] = old * 2
    del batch
    for _ in range(10):
        store.sample(8)
    assert torch.equal(old, copy)


def test_a_batch_changed_by_the_user_comes_back_with_the_layout_s_keys_only():
    store = filled_store()
    batch = store.sample(8)
    address = batch["obs"].data_ptr()
    batch["advantage"] = torch.zeros(8)
    batch["obs"] = torch.zeros(8, 2, dtype=torch.float64)
    del batch["reward"], batch["next", "obs"]
    del batch
    again = store.sample(8)
    assert again["obs"].data_ptr() == address   # the same buffer, rebuilt as the layout
    assert keys_of(again) == {"obs", ("next", "obs"), "action", "reward", "terminated", "truncated"} | SYSTEM
    np.testing.assert_array_equal(again["obs"][:, 1].numpy(), again["step"].numpy())


def test_a_pool_keeps_at_most_max_slots_per_layout_and_gathers_fresh_beyond():
    pool = SlotPool(max_slots=2)
    spec = SlotSpec(8, ((np.dtype(np.int64), (1,), 0),), ((("x",), "int64", 0, 8, (1,)),), (1,))
    held = []
    for value in range(5):
        outs, td = pool.claim("layout", spec)
        outs[0][:] = value
        held.append(td)
    assert [td["x"].item() for td in held] == list(range(5))
    assert len({td["x"].data_ptr() for td in held}) == 5
    assert len(pool._slots["layout"]) == 2
    kept_addresses = {td["x"].data_ptr() for td in held[:2]}
    del held, td
    assert pool.claim("layout", spec)[1]["x"].data_ptr() in kept_addresses


@pytest.mark.parametrize("kept", ["first", "last", "a view of one"])
def test_a_slot_of_several_batches_is_reused_only_once_no_batch_of_it_is_kept(kept):
    # sample_iter gathers the batches of a draw into one slot of parts: each part its
    # own TensorDict over its rows, and one kept part keeps every other from reuse.
    pool = SlotPool()
    spec = SlotSpec(48, ((np.dtype(np.int64), (6,), 0),), ((("x",), "int64", 0, 48, (6,)),),
                    (6,), parts=3)
    outs, parts = pool.claim("layout", spec)
    outs[0][:] = np.arange(6)
    assert [part.batch_size for part in parts] == [torch.Size([2])] * 3
    assert [part["x"].tolist() for part in parts] == [[0, 1], [2, 3], [4, 5]]
    address = parts[0]["x"].data_ptr()
    keep = {"first": parts[0], "last": parts[2], "a view of one": parts[1]["x"][1:]}[kept]
    expected = {"first": [0, 1], "last": [4, 5], "a view of one": [3]}[kept]
    del parts
    outs, again = pool.claim("layout", spec)
    outs[0][:] = -1
    assert again[0]["x"].data_ptr() != address   # a new slot: the kept part's rows stay
    assert (keep if kept == "a view of one" else keep["x"]).tolist() == expected
    del again
    assert pool.claim("layout", spec)[1][0]["x"].data_ptr() != address   # the second slot, free again
    del keep
    claimed = [pool.claim("layout", spec)[1] for _ in range(2)]
    assert address in {parts[0]["x"].data_ptr() for parts in claimed}   # nothing kept: reused


def test_a_pool_over_max_bytes_drops_its_least_recently_used_layouts():
    pool = SlotPool(max_bytes=3 * 4096)
    for name in "abcd":
        spec = SlotSpec(4096, ((np.dtype(np.uint8), (4096,), 0),), ((("x",), "uint8", 0, 4096, (4096,)),),
                        (4096,))
        pool.claim(name, spec)
    assert list(pool._slots) == ["b", "c", "d"]
    assert pool._bytes == 3 * 4096


def test_resident_memory_stays_flat_across_a_thousand_samples():
    store = ab.ExperienceStore(capacity=3_000, seed=0)
    for tag in range(10):
        store.add_episode({"obs": np.full((201, 1024), tag, np.float32), "action": np.zeros(200, np.int64),
                           "terminated": np.arange(200) == 199})
    recent = []
    for _ in range(50):   # warm up: the pool reaches its steady size
        recent = [*recent[-2:], store.sample(256)]   # a trainer holding its last few batches (2 MB each)
    gc.collect()
    before = psutil.Process().memory_info().rss
    for _ in range(1000):
        recent = [*recent[-2:], store.sample(256)]
    gc.collect()
    growth = psutil.Process().memory_info().rss - before
    assert growth < 32 << 20, f"resident memory grew by {growth >> 20} MB over 1,000 samples of 2 MB"


# -- pooled gathers against a fresh reference ------------------------------------------


def reference_columns() -> dict[str, np.ndarray]:
    rows = np.arange(12)
    return {"obs": np.stack([rows * 10.0, rows * 10.0 + 1], -1).astype(np.float32),
            "action": (rows * 100).astype(np.int64), "flag": rows % 3 == 0, "half": rows.astype(np.uint16)}


def reference_gather(columns: dict[str, np.ndarray]) -> Gather:
    return Gather({("obs",): (columns["obs"], "obs", "float32"),
                   ("next", "obs"): (columns["obs"], "next", "float32"),
                   ("action",): (columns["action"], "step", "int64"),
                   ("flag",): (columns["flag"], "step", "bool"),
                   ("half",): (columns["half"], "step", "bfloat16")})


def expected(columns: dict[str, np.ndarray], rows: np.ndarray, keys: list) -> dict:
    reads = {("obs",): columns["obs"][rows], ("next", "obs"): columns["obs"][rows + 1],
             ("action",): columns["action"][rows], ("flag",): columns["flag"][rows],
             ("half",): columns["half"][rows]}
    return {**{key: reads[key] for key in keys}, ("index",): rows * 7}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


ALL_KEYS = [("obs",), ("next", "obs"), ("action",), ("flag",), ("half",)]


@settings(max_examples=40, deadline=None)
@given(draws=st.lists(st.tuples(st.lists(st.sampled_from(ALL_KEYS), min_size=0, max_size=5, unique=True),
                                st.lists(st.integers(0, 10), min_size=1, max_size=6), st.booleans()),
                      min_size=1, max_size=12))
def test_pooled_gathers_equal_a_fresh_reference_for_any_keys_and_stay_while_kept(draws):
    columns = reference_columns()
    gather = reference_gather(columns)
    kept = []
    for keys, rows, keep in draws:
        rows = np.array(rows)
        checked = gather.check_keys(keys)
        batch = gather(rows, {"index": rows * 7}, keys=checked)
        fresh = gather.payload(rows, {"index": rows * 7}, keys=checked).to_tensordict()
        want = expected(columns, rows, keys)
        assert keys_of(batch) == {k[0] if len(k) == 1 else k for k in want} == keys_of(fresh)
        for key, value in want.items():
            np.testing.assert_array_equal(as_numpy(batch.get(key)), value)
            np.testing.assert_array_equal(as_numpy(fresh.get(key)), value)
        if keep:
            kept.append((batch, want))
        del batch
    for batch, want in kept:
        for key, value in want.items():
            np.testing.assert_array_equal(as_numpy(batch.get(key)), value)


# -- pinned slots (the pooling logic runs on the CPU: pinning needs CUDA) ---------------


class FakeEvent:
    """A CUDA event stand-in: ``done`` says whether the copy it marks has finished."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def pinning(monkeypatch):
    """Samples take the pinned path (as with pin_memory=True on a CUDA machine)."""
    import arrowbuf.tensors

    monkeypatch.setattr(arrowbuf.tensors, "pinned", lambda pin_memory, device: bool(pin_memory))


def pinned_slots(store: ab.ExperienceStore) -> int:
    return sum(len(slots) for key, slots in store.engine.shard.gatherer._pool._slots.items() if isinstance(key, tuple) and key[0] == "pinned")


def test_pinned_samples_reuse_a_dropped_batch_s_pinned_slot_and_never_a_kept_one(pinning):
    store = filled_store()
    batch = store.sample(8, pin_memory=True)
    address = batch["obs"].data_ptr()
    del batch
    kept = store.sample(8, pin_memory=True)
    assert kept["obs"].data_ptr() == address                        # the dropped batch's slot again
    before = snapshot(kept)
    for _ in range(10):
        assert store.sample(8, pin_memory=True)["obs"].data_ptr() != address
    assert_unchanged(kept, before)
    pageable = store.sample(8)
    assert not overlaps(span(pageable["obs"]), span(kept["obs"]))   # pinned and pageable slots are apart
    assert pageable.to_dict().keys() == kept.to_dict().keys()
    np.testing.assert_array_equal(kept["obs"][:, 1].numpy(), kept["step"].numpy())
    assert pinned_slots(store) == 2   # the kept batch's and the one the later samples shared


def test_a_pinned_slot_with_a_copy_in_flight_is_reused_only_once_the_copy_is_done():
    pool = SlotPool()
    spec = SlotSpec(8, ((np.dtype(np.int64), (1,), 0),), ((("x",), "int64", 0, 8, (1,)),), (1,))
    slot, td = pool.claim_slot("layout", spec, pinned=True)
    assert td["x"].is_pinned() == torch.cuda.is_available()
    event = FakeEvent()
    slot.in_flight(event)   # what a non-blocking copy to the GPU marks
    del td
    busy, td = pool.claim_slot("layout", spec, pinned=True)
    assert busy is not slot   # nothing refers to it, but the copy may still read it
    del td
    event.done = True
    assert pool.claim_slot("layout", spec, pinned=True)[0] is slot
    assert pool.claim_slot("layout", spec)[0] not in (slot, busy)   # pageable slots are kept apart


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_samples_reuse_their_pinned_slot_once_the_copy_is_done():
    store = filled_store()
    first = store.sample(8, device="cuda")
    torch.cuda.synchronize()
    expected = first["obs"].cpu()
    for _ in range(5):
        assert store.sample(8, device="cuda")["obs"].is_cuda
        torch.cuda.synchronize()   # each copy done before the next sample: one pinned slot serves all
    assert pinned_slots(store) == 1
    assert torch.equal(first["obs"].cpu(), expected)   # a device copy: later samples never touch it


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_or_cuda_sample_gathers_only_the_named_keys():
    store = filled_store()
    pinned = store.sample(8, pin_memory=True, keys=["obs"])
    assert keys_of(pinned) == {"obs"} | SYSTEM and pinned["obs"].is_pinned()
    on_gpu = store.sample(8, device="cuda", keys=[("next", "obs")])
    assert keys_of(on_gpu) == {("next", "obs")} | SYSTEM and on_gpu["next", "obs"].is_cuda
