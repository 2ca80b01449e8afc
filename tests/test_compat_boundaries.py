"""arrowbuf.compat loses no transition at an episode boundary, whatever the env's autoreset style,
with the default ``autoreset_mode`` (read from the records: RLightning's configs cannot set it).

Each pattern plays fake env workers (`support.compat_envs.VecWorker`, which log every
transition they play) through an engine's call sequence, on the local and the Ray
backends, and counts what the buffer lost against that log (`support.compat_envs.losses`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arrowbuf.compat import ReplayBuffer, compute_gae

from support.compat_envs import VecWorker, losses, rsl_rollout, sync_rollout

#: (id, autoreset style, final-observation key or None, engine)
PATTERNS = [
    ("next-step", "next_step", None, "sync"),
    ("same-step, final observation", "same_step", "final_observation", "sync"),
    ("same-step, gymnasium final_obs", "same_step", "final_obs", "sync"),
    ("same-step, no final observation", "same_step", None, "sync"),
    ("RSL re-added records, same-step, no final observation", "same_step", None, "rsl"),
    ("RSL re-added records, same-step, final observation", "same_step", "final_observation", "rsl"),
    ("RSL re-added records, next-step", "next_step", None, "rsl"),
]


@pytest.fixture(params=["local", "ray"])
def backend(request) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


def play(backend: str, autoreset: str, final_key: str | None, engine: str, auto_truncate: bool = True,
         **buffer_args) -> tuple[ReplayBuffer, list[VecWorker]]:
    workers = [VecWorker(k, num_envs=6, autoreset=autoreset, seed=20 + k, final_key=final_key) for k in range(2)]
    config = {"type": "ReplayBuffer", "capacity": 10_000, "auto_truncate_episode": auto_truncate}
    buffer = ReplayBuffer(config, seed=0, backend=backend, **buffer_args)
    buffer.init([w.meta() for w in workers])
    if engine == "sync":
        sync_rollout(buffer, workers, steps=27)
    else:
        first = None
        for _ in range(3):   # the RSL engine re-adds a rollout's last EnvRet as the next one's first record
            first = rsl_rollout(buffer, workers, steps=9, first=first)
    return buffer, workers


def close(buffer: ReplayBuffer) -> None:
    if buffer.backend == "ray":
        buffer.store.close()


#: Every pattern locally; on Ray (where each buffer starts its shard actors, a second or two of the suite)
#: each way an episode reaches the sink: cut at a next-step reset, at a same-step reset with and without
#: its final observation, and the RSL engine's re-added records. The key a final observation comes under
#: and the RSL engine's other styles are read before the sink, the same on both backends.
TRUNCATED = [("local", *p) for p in PATTERNS] + [("ray", *p) for p in PATTERNS if p[0] in (
    "next-step", "same-step, final observation", "same-step, no final observation",
    "RSL re-added records, same-step, final observation")]


@pytest.mark.parametrize("backend, name, autoreset, final_key, engine", TRUNCATED,
                         ids=[f"{b}-{name}" for b, name, *_ in TRUNCATED], indirect=["backend"])
def test_auto_truncation_loses_no_transition_in_any_boundary_pattern(backend, name, autoreset, final_key, engine):
    buffer, workers = play(backend, autoreset, final_key, engine)
    try:
        counts = losses(buffer[:], workers)
        played = sum(len(w.truth) for w in workers)
        assert len(buffer) == played
        assert {k: counts[k] for k in ("lost", "extra", "wrong_next", "unknown_mid")} == \
            {"lost": 0, "extra": 0, "wrong_next": 0, "unknown_mid": 0}, name
        if final_key is None and autoreset == "same_step":   # the terminal observations were never sent
            assert counts["unknown"] > 0
        elif autoreset == "same_step":
            assert counts["unknown"] == 0
        else:   # next-step: only an episode that ends on a rollout's last record (no record after it says how)
            assert counts["unknown"] <= 12 * (1 if engine == "sync" else 3)
    finally:
        close(buffer)


#: Without auto truncation, every pattern locally, and one of each engine on Ray (the Ray sink
#: stores what the same segmenter cut; each Ray buffer starts its shard actors, a second of the suite)
UNTRUNCATED = [("local", *p) for p in PATTERNS] + [("ray", *p) for p in PATTERNS if p[0] in (
    "same-step, no final observation", "RSL re-added records, same-step, no final observation")]


@pytest.mark.parametrize("backend, name, autoreset, final_key, engine", UNTRUNCATED,
                         ids=[f"{b}-{name}" for b, name, *_ in UNTRUNCATED], indirect=["backend"])
def test_without_auto_truncation_every_played_transition_is_in_a_rollout_window(backend, name, autoreset, final_key,
                                                                                 engine):
    buffer, workers = play(backend, autoreset, final_key, engine, auto_truncate=False)
    try:
        assert losses(buffer[:], workers)["lost"] == 0, name
    finally:
        close(buffer)


def test_todays_next_step_reading_loses_a_transition_per_same_step_reset_and_the_default_loses_none():
    """IsaacLab / RSL-RL with ``info={}`` (WBC, a smaller shape): read as next-step, as main read it by
    default, the done record's action and the next record's reward are dropped at every reset."""
    forced, workers = play("local", "same_step", None, "rsl", autoreset_mode="next_step")
    resets = sum(1 for w in workers for t in w.truth if t[4] or t[5])
    counts = losses(forced[:], workers)
    assert resets > 10 and counts["lost"] >= resets - 2 * 6 and counts["lost"] > 0   # (a rollout's last step
    # can end an episode: the next rollout then opens on it)
    default, workers = play("local", "same_step", None, "rsl")
    assert losses(default[:], workers)["lost"] == 0


def test_a_time_out_without_a_final_observation_bootstraps_from_the_steps_own_value():
    buffer, workers = play("local", "same_step", None, "sync")
    stored = buffer[:]
    blind = ~stored["next_observation_valid"]
    assert blind.any() and (stored["next_observation"][blind] == stored["observation"][blind]).all()
    # compute_gae with the column: RSL-RL's reward += gamma * V(obs_t) * time_out
    rewards = torch.tensor([[1.0], [2.0]])
    values = torch.tensor([[0.5], [3.0]])
    next_values = torch.tensor([[3.0], [99.0]])          # 99: the value of a wrong (new episode's) observation
    dones = torch.tensor([[False], [True]])
    valid = torch.tensor([[True], [False]])
    adv, ret = compute_gae(rewards, values, next_values, dones, gamma=0.9, lam=1.0, normalize_adv=False,
                           terminated=torch.zeros(2, 1, dtype=torch.bool), next_observation_valid=valid)
    last = 2.0 + 0.9 * 3.0                                 # r + gamma * V(obs_t)
    assert ret[1, 0].item() == pytest.approx(last)
    assert ret[0, 0].item() == pytest.approx(1.0 + 0.9 * last)
    # the store's own GAE bootstraps a cut episode from its final observation row: that step's observation
    store = buffer.store
    store.compute_gae(gamma=0.9, lam=0.95, value_key="value",
                      bootstrap_value=lambda obs: obs["observation"][:, 2] * 0.5)   # = the policy's value of it
    after = buffer[:]
    rows = blind & after["truncated"]
    assert rows.any()
    # a one-step view: delta = r + gamma * V(obs_t) - V(obs_t) at those steps, V = t / 2
    v = after["value"][rows].double()
    delta = after["reward"][rows].double() + 0.9 * v - v
    assert np.allclose(after["advantage"][rows].double().numpy(), delta.numpy(), rtol=1e-5)


def test_the_n_step_next_observation_of_a_step_whose_next_is_unknown_is_its_own():
    buffer, _ = play("local", "same_step", None, "sync")
    batch = buffer.store.sample(512, n_step=3, gamma=0.9)
    blind = ~batch["next_observation_valid"]
    assert blind.any()
    assert (batch["next", "observation"][blind] == batch["observation"][blind]).all()
    assert (batch["n_steps"][blind] == 1).all()


def stored_rows(buffer: ReplayBuffer) -> list[tuple]:
    """Every stored transition with its env and step, its next observation and whether that is known
    (not its episode id or index: those number episodes in the order they were written)."""
    batch = buffer[:]
    episodes = buffer.store.episodes()
    env_of = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("env_id").to_pylist()))
    envs = [env_of[e] for e in batch["episode_id"].tolist()]
    return sorted(zip(envs, batch["step"].tolist(),
                      map(tuple, batch["observation"].tolist()), batch["action"].tolist(), batch["reward"].tolist(),
                      map(tuple, batch["next_observation"].tolist()), batch["terminated"].tolist(),
                      batch["truncated"].tolist(), batch["next_observation_valid"].tolist()))


@pytest.mark.parametrize("name, autoreset, final_key, engine", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_sub_envs_cut_together_are_written_as_one_window_that_stores_what_their_pieces_store(
        name, autoreset, final_key, engine, monkeypatch):
    """Sub-envs whose episodes start at one record and end at another go to the store in one
    ``add_episodes`` call (the WBC ingest: 4,096 episodes cut at a rollout's end); what that stores,
    row by row, is what one ``add_episode`` a sub-env stores, in every boundary pattern (final
    observations given, not known, or both in one window)."""
    import arrowbuf.compat.segments as segments
    from arrowbuf.store import ExperienceStore

    batched = []
    add_episodes = ExperienceStore.add_episodes
    monkeypatch.setattr(ExperienceStore, "add_episodes",
                        lambda self, episodes, **kw: batched.append(1) or add_episodes(self, episodes, **kw))
    windows, _ = play("local", autoreset, final_key, engine)
    assert batched, "no sub-envs were cut together"
    monkeypatch.setattr(segments, "_WINDOW_ENVS", 10 ** 9)   # one add_episode per sub-env, as before
    pieces, _ = play("local", autoreset, final_key, engine)
    assert stored_rows(windows) == stored_rows(pieces)
    assert played_order(windows) == played_order(pieces)


def played_order(buffer: ReplayBuffer) -> list:
    """The stored episodes in the order they were written (their ids number them so)."""
    return buffer.store.episodes().select(["episode_id", "env_id", "length", "return"]).to_pylist()


@pytest.mark.parametrize("capacity, mode", [(14, "circular"), (9, "fixed")])
def test_windows_keep_the_sub_env_order_of_pieces_through_evictions_and_a_full_fixed_buffer(capacity, mode, monkeypatch):
    """Windows written before the single sub-envs of the same records gave other ids, so a small
    ring evicted other episodes and a fixed buffer filled with others (a reviewer's case)."""
    import arrowbuf.compat.segments as segments
    from arrowbuf.compat.sink import BufferFullError

    def play_small() -> tuple:
        worker = VecWorker(0, num_envs=3, autoreset="next_step", seed=8, final_key=None)
        buffer = ReplayBuffer({"type": "ReplayBuffer", "capacity": capacity, "auto_truncate_episode": True,
                               "storage": {"mode": mode}}, seed=0, backend="local")
        buffer.init([worker.meta()])
        refused = 0
        for _ in range(2):
            try:
                sync_rollout(buffer, [worker], steps=6)
            except BufferFullError:
                refused += 1
        return played_order(buffer), stored_rows(buffer), refused

    windows = play_small()
    monkeypatch.setattr(segments, "_WINDOW_ENVS", 10 ** 9)
    assert windows == play_small() and (windows[2] > 0) == (mode == "fixed")


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_circular_buffer_stores_the_episodes_of_a_write_with_add_episodes(backend, monkeypatch):
    """A circular Ray buffer sends the episodes a record (or a rollout's end) finishes with one
    ``add_episodes`` (one request a shard): an ``add_episode`` each was a round trip each (WBC,
    4,096 envs on 2 shards: 1.8 s a rollout's end, against 0.13 s locally). A local one stores the
    single pieces between windows with one (one run of the ring: WBC with a 1/20 reset rate, a
    rollout's steps and end 0.68-0.83 s -> 0.56-0.64 s)."""
    from arrowbuf.store import ExperienceStore

    calls = []
    add_episodes = ExperienceStore.add_episodes
    monkeypatch.setattr(ExperienceStore, "add_episodes",   # (counted by the ids: a window is [E, T, ...] arrays)
                        lambda self, episodes, **kw: calls.append(len(ids := add_episodes(self, episodes, **kw))) or ids)
    monkeypatch.setattr(ExperienceStore, "add_episode", lambda *a, **kw: pytest.fail("an add_episode per episode"))
    buffer, workers = play(backend, "same_step", "final_observation", "sync")
    try:
        counts = losses(buffer[:], workers)
        assert counts["lost"] == counts["extra"] == counts["wrong_next"] == 0
        assert sum(calls) == buffer.store.num_episodes and max(calls) > 1
    finally:
        close(buffer)
