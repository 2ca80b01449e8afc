"""TorchRL in and out: collector batches stored with `extend`, samples in TorchRL's layout,
TorchRL's losses consuming them, and TorchRL's replay-buffer verbs."""

from __future__ import annotations

import difflib
import json
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import arrowbuf as ab
from arrowbuf.errors import SchemaError

with warnings.catch_warnings():   # torchrl 0.14 warns of its own deprecated classes at import
    warnings.simplefilter("ignore", DeprecationWarning)
    from tensordict.nn import TensorDictSequential
    from torchrl.collectors import Collector
    from torchrl.envs import Compose, GymEnv, RewardSum, SerialEnv, StepCounter, TransformedEnv
    from torchrl.modules import MLP, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss

def collected(num_envs: int, frames: int, batches: int, seed: int = 0) -> list[TensorDict]:
    """What a real TorchRL collector yields on CartPole, random policy ([T] for one env)."""
    torch.manual_seed(seed)
    env = GymEnv("CartPole-v1") if num_envs == 1 else SerialEnv(num_envs, lambda: GymEnv("CartPole-v1"))
    env.set_seed(seed)
    collector = Collector(env, None, frames_per_batch=frames, total_frames=frames * batches)
    try:
        return [td.clone() for td in collector]
    finally:
        collector.shutdown()


def transitions(batch: TensorDict) -> dict[bytes, tuple]:
    """(action, next obs, reward, terminated, truncated) by observation bytes, of TorchRL-layout rows."""
    return {obs.numpy().tobytes(): (action.tolist(), nxt.tolist(), float(reward), bool(term), bool(trunc))
            for obs, action, nxt, reward, term, trunc in zip(
                batch["observation"], batch["action"], batch["next", "observation"], batch["next", "reward"],
                batch["next", "terminated"], batch["next", "truncated"])}


def test_extend_of_a_real_collector_stores_every_frame_as_the_transition_it_was():
    data = collected(num_envs=2, frames=60, batches=3)
    store = ab.ExperienceStore(10_000, seed=0)
    for td in data:
        store.extend(td)
    assert len(store) == 180 == sum(td.numel() for td in data)
    played = {}
    for td in data:
        played.update(transitions(td.reshape(-1)))
    stored = {}
    for batch in store.iter_batches(64, shuffle=False, layout="torchrl"):
        stored.update(transitions(batch))
    assert stored == played
    # An episode per done flag, plus one cut per env and batch that ended open.
    dones = sum(int(td["next", "done"].sum()) for td in data)
    open_tails = sum(int((~td["next", "done"][:, -1, 0]).sum()) for td in data)
    assert store.num_episodes == dones + open_tails


def test_an_open_trajectory_continues_as_an_episode_of_the_same_traj_id():
    first, second = collected(num_envs=1, frames=40, batches=2, seed=3)
    assert not first["next", "done"][-1]    # the seed leaves an episode open across the batches
    store = ab.ExperienceStore(1_000)
    store.extend(first)
    store.extend(second)
    table = store.episodes()
    traj_ids = [json.loads(m)["traj_id"] for m in table.column("metadata").to_pylist()]
    open_id = int(first["collector", "traj_ids"][-1])
    assert traj_ids.count(open_id) == 2
    cut, continued = [i for i, t in zip(table.column("episode_id").to_pylist(), traj_ids) if t == open_id]
    cut_rows, continued_rows = store.episode(cut), store.episode(continued)
    # The cut ends neither terminated nor truncated, with the true next observation as its final one.
    assert not cut_rows.column("terminated").to_pylist()[-2][0] and not cut_rows.column("truncated").to_pylist()[-2][0]
    np.testing.assert_array_equal(np.array(cut_rows.column("observation").to_pylist()[-1], np.float32),
                                  second["observation"][0].numpy())
    assert continued_rows.num_rows >= 2


@settings(max_examples=40, deadline=None)
@given(num_envs=st.integers(1, 4), steps=st.integers(1, 12), data=st.data())
def test_extend_cuts_at_done_flags_trajectory_changes_and_masks_and_keeps_each_step(num_envs, steps, data):
    done = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_envs * steps, max_size=num_envs * steps)))
    done = done.reshape(num_envs, steps)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_envs * steps, max_size=num_envs * steps)))
    mask = mask.reshape(num_envs, steps)
    # Trajectory ids as a collector numbers them: a new one after each done step.
    traj = torch.cumsum(torch.cat([torch.zeros(num_envs, 1, dtype=torch.long), done[:, :-1].long()], 1), 1)
    traj = traj + 100 * torch.arange(num_envs)[:, None]
    obs = torch.arange(num_envs * steps, dtype=torch.float32).reshape(num_envs, steps, 1)
    td = TensorDict({"observation": obs, "action": obs.long().squeeze(-1) * 2,
                     "collector": {"traj_ids": traj, "mask": mask},
                     "next": {"observation": obs + 1, "reward": obs, "done": done[..., None],
                              "terminated": done[..., None], "truncated": torch.zeros_like(done)[..., None]}},
                    batch_size=[num_envs, steps])
    store = ab.ExperienceStore(10_000)
    store.extend(td)
    assert len(store) == int(mask.sum())
    if not mask.any():
        return
    rows = list(store.iter_batches(10_000, shuffle=False, layout="torchrl"))[0]
    kept = obs[mask].squeeze(-1)
    order = torch.argsort(rows["observation"].squeeze(-1))
    torch.testing.assert_close(rows["observation"].squeeze(-1)[order], kept)
    torch.testing.assert_close(rows["next", "observation"].squeeze(-1)[order], kept + 1)
    torch.testing.assert_close(rows["action"][order], kept.long() * 2)
    assert torch.equal(rows["next", "terminated"].squeeze(-1)[order], done[mask])
    # Episodes: one per run of kept steps of one row, cut after each done step.
    flat_keep = torch.nonzero(mask.reshape(-1)).reshape(-1)
    cuts = done.reshape(-1)[flat_keep].clone()
    cuts[:-1] |= (flat_keep[1:] != flat_keep[:-1] + 1) | (flat_keep[1:] // steps != flat_keep[:-1] // steps)
    cuts[-1] = True
    assert store.num_episodes == int(cuts.sum())


def test_extend_takes_a_flat_batch_of_interleaved_trajectories_by_their_ids():
    obs = torch.arange(6, dtype=torch.float32)[:, None]
    traj = torch.tensor([0, 0, 0, 1, 1, 1])   # two envs' trajectories, one after the other, neither done
    td = TensorDict({"observation": obs, "action": torch.zeros(6, dtype=torch.long), "collector": {"traj_ids": traj},
                     "next": {"observation": obs + 10, "reward": torch.ones(6, 1),
                              "done": torch.zeros(6, 1, dtype=torch.bool),
                              "terminated": torch.zeros(6, 1, dtype=torch.bool)}}, batch_size=[6])
    store = ab.ExperienceStore(100)
    assert store.extend(td) == [0, 1]
    assert store.episode(1).column("observation").to_pylist() == [[3.0], [4.0], [5.0], [15.0]]


def test_extend_refuses_what_is_no_collector_batch_and_leaves_the_store_unchanged():
    store = ab.ExperienceStore(100)
    with pytest.raises(ValueError, match="collector yields.*add_episodes"):
        store.extend({"observation": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="batch size"):
        store.extend(TensorDict({"observation": torch.zeros(2, 2, 2, 1)}, batch_size=[2, 2, 2]))
    with pytest.raises(SchemaError, match="'terminated'.*'done'"):
        store.extend(TensorDict({"observation": torch.zeros(3, 1), "next": {"observation": torch.zeros(3, 1),
                                                                            "reward": torch.zeros(3, 1)}}, [3]))
    assert len(store) == 0 and store.schema is None


def test_the_torchrl_layout_of_a_writer_store_renames_obs_and_moves_flags_under_next():
    store = ab.ExperienceStore(100, seed=0, sampler=ab.PrioritizedSampler())
    store.add_episode({"obs": np.arange(6, dtype=np.float32).reshape(3, 2), "action": np.array([1, 0]),
                       "reward": np.array([0.5, 1.5], np.float32), "terminated": np.array([False, True]),
                       "truncated": np.zeros(2, bool)})
    batch = store.sample(16, layout="torchrl")
    assert {"observation", "action", "index", "priority_weight"} <= set(batch.keys())
    assert "obs" not in batch.keys() and "reward" not in batch.keys() and "terminated" not in batch.keys()
    for key in ("reward", "done", "terminated", "truncated"):
        assert batch["next", key].shape == (16, 1)
    first = batch["step"] == 0
    assert torch.equal(batch["next", "done"][:, 0], ~first)
    torch.testing.assert_close(batch["next", "observation"], batch["observation"] + 2)
    torch.testing.assert_close(batch["priority_weight"], batch["weight"])
    plain = store.sample(4)
    assert "obs" in plain.keys() and plain["reward"].shape == (4,)
    with pytest.raises(ValueError, match="layout must be one of"):
        store.sample(4, layout="rlds")
    assert [len(b) for b in store.iter_batches(1, layout="torchrl", epochs=2)] == [1, 1, 1, 1]


def test_dqn_loss_trains_on_prioritized_arrowbuf_batches_of_a_real_collector():
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    actor = QValueActor(MLP(out_features=2, num_cells=[16]), in_keys=["observation"], spec=env.action_spec)
    policy = TensorDictSequential(actor, EGreedyModule(env.action_spec, eps_init=1.0))
    collector = Collector(env, policy, frames_per_batch=40, total_frames=120, auto_register_policy_transforms=True)
    store = ab.ExperienceStore(10_000, seed=0, sampler=ab.PrioritizedSampler(alpha=0.7))
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=False)
    optim = torch.optim.Adam(loss.parameters(), lr=1e-2)
    losses = []
    try:
        for data in collector:
            store.extend(data)
            batch = store.sample(32, layout="torchrl")
            loss_td = loss(batch)
            optim.zero_grad()
            loss_td["loss"].backward()
            optim.step()
            assert store.update_tensordict_priority(batch) == 32   # the loss wrote "td_error"
            losses.append(float(loss_td["loss"].detach()))
    finally:
        collector.shutdown()
    assert len(losses) == 3 and all(np.isfinite(losses))
    errors = batch["td_error"].reshape(-1)
    assert torch.count_nonzero(errors) > 0
    assert store.update_priority(batch["index"], torch.ones(32)) == 32


TORCHRL_LOOP = """
import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

torch.manual_seed(0)
env = GymEnv("CartPole-v1")
actor = QValueActor(MLP(out_features=2, num_cells=[32]), in_keys=["observation"], spec=env.action_spec)
policy = TensorDictSequential(actor, EGreedyModule(env.action_spec, eps_init=0.5))
collector = Collector(env, policy, frames_per_batch=50, total_frames=200, auto_register_policy_transforms=True)
rb = ReplayBuffer(storage=LazyTensorStorage(10_000), batch_size=32)
loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
updater = SoftUpdate(loss, eps=0.99)
for data in collector:
    rb.extend(data)
    for _ in range(2):
        loss_td = loss(rb.sample())
        optim.zero_grad()
        loss_td["loss"].backward()
        optim.step()
        updater.step()
collector.shutdown()
"""

ARROWBUF_LOOP = """
import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
import arrowbuf as ab
from torchrl.envs import GymEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

torch.manual_seed(0)
env = GymEnv("CartPole-v1")
actor = QValueActor(MLP(out_features=2, num_cells=[32]), in_keys=["observation"], spec=env.action_spec)
policy = TensorDictSequential(actor, EGreedyModule(env.action_spec, eps_init=0.5))
collector = Collector(env, policy, frames_per_batch=50, total_frames=200, auto_register_policy_transforms=True)
rb = ab.ExperienceStore(10_000, seed=0)
loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
updater = SoftUpdate(loss, eps=0.99)
for data in collector:
    rb.extend(data)
    for _ in range(2):
        loss_td = loss(rb.sample(32, layout="torchrl"))
        optim.zero_grad()
        loss_td["loss"].backward()
        optim.step()
        updater.step()
collector.shutdown()
"""


def changed_lines(before: str, after: str) -> int:
    """Lines a diff changes: a replaced block counts its longer side."""
    matcher = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


def test_a_torchrl_dqn_loop_switches_to_arrowbuf_in_at_most_ten_changed_lines_and_both_run():
    assert changed_lines(TORCHRL_LOOP, ARROWBUF_LOOP) <= 10
    results = {}
    for name, source in (("torchrl", TORCHRL_LOOP), ("arrowbuf", ARROWBUF_LOOP)):
        scope: dict = {}
        exec(compile(source, f"<{name} DQN loop>", "exec"), scope)
        results[name] = (len(scope["rb"]), float(scope["loss_td"]["loss"].detach()))
    assert results["torchrl"][0] == results["arrowbuf"][0] == 200   # every frame, in both
    assert all(np.isfinite(loss) for _, loss in results.values())


def test_torchrl_verbs_work_or_name_arrowbufs(tmp_path):
    store = ab.ExperienceStore(100, seed=0)
    store.add_episode({"obs": np.arange(4, dtype=np.float32)[:, None], "action": np.arange(3),
                       "terminated": np.array([False, False, True]), "truncated": np.zeros(3, bool)})
    batch = store.sample(5)
    assert torch.equal(store[batch["index"]]["action"], batch["action"])
    assert int(store[int(batch["index"][0])]["action"]) == int(batch["action"][0])
    with pytest.raises(TypeError, match="gather"):
        store[0:2]
    with pytest.raises(TypeError, match="iter_batches.*sample_iter"):
        iter(store)
    with pytest.raises(TypeError, match=re.escape("store.save(path)")):
        store.state_dict()
    with pytest.raises(TypeError, match=re.escape("ExperienceStore.load(path)")):
        store.load_state_dict({})
    store.dumps(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    assert len(loaded) == len(store) == 3
    with pytest.raises(TypeError, match="ExperienceStore.load"):
        store.loads(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="PrioritizedSampler"):
        store.update_priority(batch["index"], torch.ones(5))



def counted_env() -> TransformedEnv:
    """CartPole with TorchRL's usual counters: ("next", "step_count") and ("next", "episode_reward")."""
    return TransformedEnv(GymEnv("CartPole-v1"), Compose(StepCounter(), RewardSum()))


def collected_counted(num_envs: int, frames: int, batches: int, seed: int = 0) -> list[TensorDict]:
    """What a real collector yields on counted CartPole envs (random policy)."""
    torch.manual_seed(seed)
    env = counted_env() if num_envs == 1 else SerialEnv(num_envs, counted_env)
    env.set_seed(seed)
    collector = Collector(env, None, frames_per_batch=frames, total_frames=frames * batches)
    try:
        return [td.clone() for td in collector]
    finally:
        collector.shutdown()


def by_observation(batch: TensorDict) -> dict[bytes, TensorDict]:
    """The transitions of a [B] TensorDict by their observation's bytes (CartPole's are unique)."""
    return {batch["observation"][i].numpy().tobytes(): batch[i] for i in range(batch.shape[0])}


def test_n_step_samples_of_a_real_collector_sum_its_one_shaped_rewards_within_each_stored_episode():
    data = collected_counted(num_envs=1, frames=50, batches=3, seed=1)
    assert data[0]["next", "reward"].shape == (50, 1) and data[0]["next", "terminated"].shape == (50, 1)
    store = ab.ExperienceStore(10_000, seed=0)
    for td in data:
        store.extend(td)
    n, gamma = 3, 0.9
    expected = {}
    for td in data:   # an episode ends at a done flag or the batch's end (extend cuts it there)
        done = td["next", "done"][:, 0]
        for t in range(len(td)):
            end = t
            while not done[end] and end < len(td) - 1:
                end += 1
            k = min(n, end - t + 1)
            rewards = td["next", "reward"][t:t + k, 0]
            expected[td["observation"][t].numpy().tobytes()] = (
                float(sum(gamma ** i * float(r) for i, r in enumerate(rewards))), k, td["next"][t + k - 1])
    batch = store.sample(64, n_step=n, gamma=gamma, layout="torchrl")
    assert batch["next", "reward"].shape == (64, 1) and batch["steps_to_next_obs"].shape == (64, 1)
    assert batch["steps_to_next_obs"].max() == n
    for key, row in by_observation(batch).items():
        reward, k, last = expected[key]
        assert float(row["next", "reward"][0]) == pytest.approx(reward, rel=1e-6)
        assert int(row["steps_to_next_obs"][0]) == k
        for name in ("observation", "terminated", "truncated", "step_count", "episode_reward"):
            assert torch.equal(row["next", name], last[name]), name
    plain = store.sample(16, n_step=n, gamma=gamma)
    assert plain["reward"].shape == (16, 1) and plain["terminated"].shape == (16, 1)
    # TorchRL's DQN loss takes the n-step batch as it is.
    actor = QValueActor(MLP(out_features=2, num_cells=[8]), in_keys=["observation"], spec=GymEnv("CartPole-v1").action_spec)
    loss = DQNLoss(actor, action_space="one-hot", delay_value=False)
    assert torch.isfinite(loss(batch)["loss"])


def test_torchrl_batches_carry_every_next_key_the_collector_gave():
    data = collected_counted(num_envs=2, frames=40, batches=2, seed=2)
    next_keys = set(data[0]["next"].keys(include_nested=True, leaves_only=True))
    assert {"step_count", "episode_reward"} <= next_keys
    played = {}
    for td in data:
        played.update(by_observation(td.reshape(-1)))
    store = ab.ExperienceStore(10_000, seed=0)
    for td in data:
        store.extend(td)
    seen = 0
    for batch in store.iter_batches(32, shuffle=False, layout="torchrl"):
        assert next_keys <= set(batch["next"].keys(include_nested=True, leaves_only=True))
        for key, row in by_observation(batch).items():
            for name in next_keys:
                assert torch.equal(row["next", name], played[key]["next", name]), name
            assert torch.equal(row["step_count"], played[key]["step_count"])
            seen += 1
    assert seen == len(store) == 80
    sampled = store.sample(8, layout="torchrl")
    assert torch.equal(sampled["next", "step_count"], sampled["step_count"] + 1)


def test_add_of_one_transition_and_sample_without_a_size_name_arrowbufs_verbs():
    td = collected_counted(num_envs=1, frames=20, batches=1)[0]
    store = ab.ExperienceStore(100, seed=0)
    store.extend(td)
    with pytest.raises(TypeError, match=r"add\(td\) of one transition.*store\.extend\(td\).*store\.writer"):
        store.add(td[0])
    assert len(store) == 20 and store.num_episodes == int(td["next", "done"].sum()) + (not td["next", "done"][-1])
    with pytest.raises(TypeError, match=re.escape("store.sample(batch_size, layout='torchrl')")):
        store.sample()


def test_add_episodes_takes_the_observation_fields_a_name_would_not_reveal():
    episodes = {"obs": np.zeros((2, 4, 3), np.float32), "step_count": np.tile(np.arange(4), (2, 1)),
                "action": np.zeros((2, 3), np.int64), "terminated": np.zeros((2, 3), bool)}
    store = ab.ExperienceStore(100, seed=0)
    with pytest.raises(SchemaError, match="'step_count' has 4 rows"):
        store.add_episodes(episodes)
    for bad, message in ((["obs", "steps"], r"names \['steps'\], not fields"), ("obs", "must be a list")):
        with pytest.raises(SchemaError, match=message):
            store.add_episodes(episodes, observations=bad)
    assert len(store) == 0 and store.schema is None
    store.add_episodes(episodes, observations=["obs", "step_count"])
    assert store.schema.observation_names == ("obs", "step_count")
    batch = store.sample(16)
    assert torch.equal(batch["next", "step_count"], batch["step_count"] + 1)
