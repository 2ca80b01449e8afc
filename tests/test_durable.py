"""Durable shards: the episode log, replay exactly once, torn tails, damage, compaction, kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.durable import DurableShard, durable_directory
from arrowbuf.engine import ShardEngine
from arrowbuf.episode_log import EpisodeLog, next_episode_id
from arrowbuf.episode_read import read_episode
from arrowbuf.errors import FormatError

from support.episodes import EPISODE_SCHEMA, make_episode


def new_engine(capacity: int = 200, shard: int = 0, num_shards: int = 1) -> ShardEngine:
    return ShardEngine(capacity, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=3,
                       shard=shard, num_shards=num_shards)


def write(durable: DurableShard, engine: ShardEngine, tags: list[int], steps: int = 5, batch=None) -> list[int]:
    """Store tagged episodes in ``engine`` and commit them as one write; returns their ids."""
    added = []
    for tag in tags:
        episode, schema = read_episode(make_episode(tag, steps), EPISODE_SCHEMA, f"env-{tag % 3}", {"tag": tag})
        added.append((engine.add(episode, schema), episode))
    durable.commit(engine, added, batch)
    return [i for i, _ in added]


def contents(engine: ShardEngine) -> dict[int, int]:
    """episode id -> tag (the obs encodes it) of every live episode."""
    table = engine.episodes()
    return {i: int(engine.episode(i).column("obs")[0].as_py()[0]) for i in table.column("episode_id").to_pylist()}


def recovered(directory: Path, make=new_engine) -> ShardEngine:
    with DurableShard(directory) as durable:
        return durable.recover(make)


def test_a_replayed_log_restores_every_committed_episode_with_its_id_and_table_row(tmp_path):
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [0, 1, 2])
    write(durable, engine, [3])
    durable.close()
    again = recovered(tmp_path)
    assert contents(again) == contents(engine) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert again.episodes().equals(engine.episodes())   # env ids, metadata, inserted_at, returns
    np.testing.assert_array_equal(again.episode(2).column("action").to_numpy(),
                                  engine.episode(2).column("action").to_numpy())


def test_pieces_of_an_episode_replay_with_the_step_they_start_at(tmp_path):
    """A Ray writer ships open episodes in pieces (`arrowbuf.piece_cutting`): a replay keeps each piece's first step."""
    import dataclasses

    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    added = []
    for first_step in (0, 5, 10):
        episode, schema = read_episode(make_episode(first_step, 5), EPISODE_SCHEMA, "env-0", None)
        piece = dataclasses.replace(episode, first_step=first_step)
        added.append((engine.add(piece, schema), piece))
    durable.commit(engine, added)
    durable.close()
    again = recovered(tmp_path)
    assert again.episodes().column("first_step").to_pylist() == [0, 5, 10]
    assert again.episodes().equals(engine.episodes())


def test_replay_after_a_checkpoint_adds_only_the_episodes_logged_after_it(tmp_path):
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [0, 1])
    durable.checkpoint(engine, {"capacity": 200, "mode": "circular", "seed": 3, "track_reuse": False,
                                "created_at": 0.0})
    write(durable, engine, [2, 3])
    durable.close()
    again = recovered(tmp_path)
    assert contents(again) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert len(again) == len(engine)
    # A second recovery (a restart that replays nothing new) still holds each episode once.
    assert contents(recovered(tmp_path)) == contents(again)


def test_a_checkpoint_compacts_the_segments_it_covers(tmp_path):
    log_bytes = lambda: sum(p.stat().st_size for p in tmp_path.glob("log-*.arrowlog"))
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, list(range(10)))
    before = log_bytes()
    info = {"capacity": 200, "mode": "circular", "seed": 3, "track_reuse": False, "created_at": 0.0}
    durable.checkpoint(engine, info)
    assert log_bytes() < before / 10   # only the new segment's start record is left
    assert len(durable.log.segments()) == 1
    write(durable, engine, [10])
    durable.close()
    assert contents(recovered(tmp_path)) == {i: i for i in range(11)}


def test_compaction_keeps_the_segments_of_episodes_appended_after_the_log_was_opened(tmp_path):
    # Segments rotated in this process once all counted as "next id 0": a checkpoint
    # covering episode 0 deleted the segments holding episodes 1 and 2 as well.
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    durable.log.segment_bytes = 1   # every record starts a new segment
    write(durable, engine, [0])
    write(durable, engine, [1])
    write(durable, engine, [2])
    durable.log.compact(upto=1)   # a checkpoint holding episode 0 only
    durable.close()
    with EpisodeLog(tmp_path) as log:
        fresh = new_engine()
        fresh.add(*read_episode(make_episode(0, 5), EPISODE_SCHEMA, "env-0", {"tag": 0}))   # the checkpoint
        assert log.replay(fresh) == 2
    assert contents(fresh) == {0: 0, 1: 1, 2: 2}


def test_a_log_append_that_fails_with_any_error_stops_the_shard_taking_writes(tmp_path, monkeypatch):
    # Only OSError used to stop it: after a MemoryError the engine held an episode the
    # log lacked, the next write was logged after a gap, and replay refused the log.
    from arrowbuf.errors import ShardError

    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [0])

    def out_of_memory(*args, **kwargs):
        raise MemoryError("building the record")

    monkeypatch.setattr(durable.log, "append", out_of_memory)
    with pytest.raises(ShardError, match="MemoryError"):
        write(durable, engine, [1])
    monkeypatch.undo()
    with pytest.raises(ShardError, match="refuses writes until it restarts"):
        write(durable, engine, [2])
    durable.close()
    assert contents(recovered(tmp_path)) == {0: 0}


def test_evictions_and_clears_replay_as_they_happened(tmp_path):
    durable = DurableShard(tmp_path)
    engine = durable.recover(lambda: new_engine(capacity=20))
    write(durable, engine, [0, 1, 2, 3])   # 6 rows each: the fourth evicts the first
    engine.clear()
    durable.cleared(engine)
    write(durable, engine, [4, 5])
    durable.close()
    again = recovered(tmp_path, lambda: new_engine(capacity=20))
    assert contents(again) == contents(engine) == {4: 4, 5: 5}
    assert next_episode_id(again) == next_episode_id(engine) == 6


def test_episode_ids_of_a_shard_in_a_sharded_store_replay_with_their_stride(tmp_path):
    make = lambda: new_engine(shard=2, num_shards=3)
    durable = DurableShard(tmp_path, shard=2, num_shards=3)
    engine = durable.recover(make)
    assert write(durable, engine, [0, 1]) == [2, 5]
    durable.close()
    assert contents(recovered(tmp_path, make)) == {2: 0, 5: 1}


def test_a_retried_write_is_recognised_after_a_restart_and_a_compaction(tmp_path):
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [0], batch=("writer-a", 1))
    write(durable, engine, [1], batch=("writer-a", 3))   # 2 is still in flight: a retry may bring it later
    assert durable.seen(("writer-a", 1)) and durable.seen(("writer-a", 3))
    assert not durable.seen(("writer-a", 2)) and not durable.seen(("writer-a", 4)) and not durable.seen(("b", 1))
    durable.checkpoint(engine, {"capacity": 200, "mode": "circular", "seed": 3, "track_reuse": False,
                                "created_at": 0.0})
    durable.close()
    again = DurableShard(tmp_path)
    again.recover(new_engine)
    assert again.seen(("writer-a", 1)) and again.seen(("writer-a", 3)) and not again.seen(("writer-a", 2))
    again.close()


@pytest.mark.usefixtures("ray_session")
def test_a_retried_add_episode_after_a_restart_is_answered_with_its_logged_ids_and_stored_once(tmp_path):
    # add_episode / add_episodes sent no batch number, so a call Ray retried after the
    # shard logged it and died was stored a second time.
    from arrowbuf.ray.actor import ShardServer

    def start() -> ShardServer:   # the actor's class, in this process: a restart is a new instance
        return ShardServer(200, 0, 1, 3, ab.UniformSampler(), ab.RateLimiter(), None, "circular",
                           durable=str(tmp_path), blocks=(64 << 20, 3600.0))

    episodes, schema = zip(*(read_episode(make_episode(tag, 5), EPISODE_SCHEMA) for tag in (0, 1)))
    server = start()
    first, _ = server.add_episodes(list(episodes), schema[0].to_json(), None, ("driver-a", 1))
    server.durable.close()   # it died before answering
    again = start()
    retried, _ = again.add_episodes(list(episodes), schema[0].to_json(), None, ("driver-a", 1))
    assert retried == first == [0, 1]
    assert contents(again.engine) == {0: 0, 1: 1}
    again.durable.close()


@pytest.mark.usefixtures("ray_session")
def test_add_episode_and_add_episodes_name_their_writes_so_a_durable_shard_can_recognise_a_retry(tmp_path):
    store = ab.ExperienceStore(400, backend="ray", num_shards=1, seed=0, durable=tmp_path)
    try:
        ids = [store.add_episode(make_episode(0, 5))] + store.add_episodes(
            {name: np.stack([column, column]) for name, column in make_episode(1, 5).items()})
    finally:
        store.close()
    with EpisodeLog(tmp_path / "shard-0") as log:
        logged = [log.logged_ids(batch) for batch in ((writer, n) for writer, (upto, _) in log.batches.items()
                                                      for n in range(1, upto + 1))]
    assert logged == [[ids[0]], ids[1:]]


def two_records(directory, heads=None):
    """A closed log of two writes: its segment and where the first record ends (``heads``
    gets the log head's bytes after each write)."""
    durable = DurableShard(directory)
    engine = durable.recover(new_engine)
    write(durable, engine, [0])
    first_end = durable.log.segments()[-1].stat().st_size
    if heads is not None:
        heads.append((directory / "log-head").read_bytes())
    write(durable, engine, [1])
    durable.close()
    return durable.log.segments()[-1], first_end


@pytest.mark.parametrize("cut", ["in its payload", "in its header"])
def test_a_torn_last_record_is_dropped_and_appends_continue_after_it(tmp_path, cut):
    heads = []
    segment, first_end = two_records(tmp_path, heads)
    # A crash in the second append: its bytes are cut, and the head (moved on only once an
    # append's bytes are flushed, before it returns) still says the first one's end.
    os.truncate(segment, segment.stat().st_size - 1 if cut == "in its payload" else first_end + 10)
    (tmp_path / "log-head").write_bytes(heads[0])
    assert contents(recovered(tmp_path)) == {0: 0}
    assert segment.stat().st_size == first_end   # the torn bytes were removed
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [7])
    durable.close()
    assert contents(recovered(tmp_path)) == {0: 0, 1: 7}


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_damaged_record_before_the_tail_raises_format_error_naming_the_file(tmp_path, where):
    segment, first_end = two_records(tmp_path)
    data = bytearray(segment.read_bytes())
    offset = first_end - 100 if where == "payload" else first_end + 6   # a value byte / the length field
    data[offset] ^= 0x10
    segment.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=segment.name):
        DurableShard(tmp_path)


def _hostile_records():
    """Records whose checksums hold but whose contents were written to break the reader."""
    import pyarrow as pa

    from arrowbuf._log_records import episodes_batch, episodes_schema, stream

    episode, schema = read_episode(make_episode(0, 5), EPISODE_SCHEMA)
    arrow_schema = episodes_schema(schema)
    batch = episodes_batch(arrow_schema, schema, [(0, episode, 0)])
    null_steps = batch.set_column(batch.num_columns - 1, "num_steps", pa.nulls(1, pa.int64()))
    as_floats = pa.schema([*arrow_schema][:-1] + [pa.field("num_steps", pa.float64())], metadata=arrow_schema.metadata)
    return {
        "writers not a map": stream(pa.schema([]), {"kind": "start", "writers": [1, 2]}),
        "clear without next_id": stream(pa.schema([]), {"kind": "clear"}),
        "batch not a pair": stream(arrow_schema, {"kind": "episodes", "batch": 5}, [batch]),
        "unknown kind": stream(pa.schema([]), {"kind": "drop-table"}),
        "null num_steps": stream(arrow_schema, {"kind": "episodes", "batch": None}, [null_steps]),
        "float num_steps": stream(as_floats, {"kind": "episodes", "batch": None},
                                  [batch.set_column(batch.num_columns - 1, "num_steps", pa.array([5.0]))]),
    }


@pytest.mark.parametrize("name", list(_hostile_records()))
def test_a_well_checksummed_but_malformed_record_raises_format_error(tmp_path, name):
    from arrowbuf._log_records import record_header

    segment, _ = two_records(tmp_path)
    payload = _hostile_records()[name]
    good = segment.read_bytes()
    segment.write_bytes(good + record_header(payload) + payload.to_pybytes())
    with pytest.raises(FormatError, match=segment.name):
        with EpisodeLog(tmp_path) as log:
            log.replay(new_engine())


def test_a_log_with_a_segment_missing_in_the_middle_raises_format_error(tmp_path):
    log = EpisodeLog(tmp_path, segment_bytes=1)   # every record starts a new segment
    engine = new_engine()
    for tag in range(3):
        episode, schema = read_episode(make_episode(tag, 5), EPISODE_SCHEMA)
        log.append([(engine.add(episode, schema), episode, 0)], engine.schema)
    log.close()
    segments = log.segments()
    holding = [p for p in segments if b"episode_id" in p.read_bytes()]
    assert len(holding) == 3
    holding[1].unlink()   # episode 1's segment, deleted by hand
    with pytest.raises(FormatError, match=f"{holding[1].name}: missing \\(deleted\\); the log head"):
        EpisodeLog(tmp_path)


KILLED_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from support.episodes import EPISODE_SCHEMA, make_episode
    from test_durable import new_engine
    from arrowbuf.durable import DurableShard
    from arrowbuf.episode_read import read_episode

    durable = DurableShard(sys.argv[1])
    engine = durable.recover(new_engine)
    tag = 0
    while True:
        added = []
        for _ in range(3):
            episode, schema = read_episode(make_episode(tag, 40), EPISODE_SCHEMA)
            added.append((engine.add(episode, schema), episode))
            tag += 1
        durable.commit(engine, added)
        print(" ".join(str(i) for i, _ in added), flush=True)   # the acknowledgement
""")


def test_a_writer_killed_mid_append_leaves_a_log_of_exactly_its_acknowledged_episodes(tmp_path):
    tests = Path(__file__).parent
    acknowledged = []
    with subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(tests)], stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
                          ) as child:
        for line in child.stdout:
            acknowledged += [int(i) for i in line.split()]
            if len(acknowledged) >= 150:
                break
        child.send_signal(signal.SIGKILL)
        acknowledged += [int(i) for line in child.stdout for i in line.split()]   # acks printed before the kill
    assert child.returncode == -signal.SIGKILL
    engine = recovered(tmp_path, lambda: new_engine(capacity=100_000))
    stored = contents(engine)
    # Every acknowledged episode, once, with its own data; at most the one unacknowledged write beyond them.
    assert set(acknowledged) <= set(stored)
    assert list(stored) == list(range(len(stored)))
    assert stored == {i: i for i in stored}
    assert len(stored) - len(acknowledged) <= 3


# -- a durable Ray store under writers ----------------------------------------------------

EPISODE_STEPS = 10


@pytest.fixture
def ray_cluster(ray_session):
    return pytest.importorskip("ray")


def durable_runner():
    """A Ray task that writes rounds of episodes through a writer handle until told the kill is over."""
    ray = pytest.importorskip("ray")

    @ray.remote
    class Gate:
        """Where the driver and the runners meet: rounds written, and the kill."""

        def __init__(self) -> None:
            self.rounds: dict[int, int] = {}
            self.killed_at: dict[int, int] | None = None

        def report(self, runner: int, rounds: int) -> bool:
            """Record progress; True when the runner may stop (three rounds written after the kill)."""
            self.rounds[runner] = rounds
            return self.killed_at is not None and rounds >= self.killed_at.get(runner, 0) + 3

        def least_rounds(self, runners: int) -> int:
            return min(self.rounds.get(r, 0) for r in range(runners))

        def kill_done(self) -> None:
            self.killed_at = dict(self.rounds)

    @ray.remote
    def run(writer, gate, runner: int) -> list[tuple[int, int, int]]:
        """Episodes (runner, env, number) of EPISODE_STEPS steps; obs = (runner, env, number, t)."""
        n = writer.num_envs
        finished, number, rounds = [], 0, 0
        while True:
            for t in range(EPISODE_STEPS):
                obs = np.stack([np.full(n, runner), np.arange(n), np.full(n, number), np.full(n, t)], 1)
                end = np.full(n, t == EPISODE_STEPS - 1)
                writer.add(obs=obs.astype(np.float32), action=np.zeros(n, np.int64), reward=np.ones(n, np.float32),
                           terminated=end, truncated=np.zeros(n, bool),
                           next_obs=(obs + [0, 0, 0, 1]).astype(np.float32))
            finished += [(runner, env, number) for env in range(n)]
            number += 1
            writer.flush()   # acknowledged: every episode so far is stored (and logged)
            rounds += 1
            if ray.get(gate.report.remote(runner, rounds)):
                return finished

    return Gate, run


def pid_of(ray, handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda server: os.getpid()))


def kill_and_await_restart(ray, handle) -> None:
    """Kill a shard actor (Ray restarts it) and wait until calls reach the new process.

    ``ray.kill`` returns before the process is gone: a call made at once may still
    be answered by the old one.
    """
    old = pid_of(ray, handle)
    ray.kill(handle, no_restart=False)
    for _ in range(600):
        if pid_of(ray, handle) != old:
            return
        time.sleep(0.1)
    raise AssertionError(f"shard actor process {old} still answers after ray.kill")


def rows_ids(rows) -> list[int]:
    """The episode ids of a store's rows, shard by shard (the order of `episodes`); a piece of an
    episode (a Ray writer ships open episodes in pieces) has an id of its own, and rows of its own."""
    ids = rows.column("episode_id").to_numpy()
    return ids[np.concatenate([[True], ids[1:] != ids[:-1]])].tolist() if len(ids) else []


def test_a_killed_durable_shard_restarts_with_every_acknowledged_episode_once_while_writers_keep_writing(
        tmp_path, ray_cluster):
    ray = ray_cluster
    Gate, run = durable_runner()
    store = ab.ExperienceStore(capacity=20_000, backend="ray", num_shards=2, seed=1, durable=tmp_path)
    try:
        gate = Gate.remote()
        writers = [store.writer(num_envs=3, autoreset_mode="disabled") for _ in range(2)]
        runs = [run.remote(w, gate, k) for k, w in enumerate(writers)]
        while ray.get(gate.least_rounds.remote(2)) < 2:
            ray.wait(runs, timeout=0.2)
        victim = ray.get_actor(f"{store.name}:0", namespace="arrowbuf")   # the shard actor to kill
        episodes_before = ray.get(victim.size.remote())[2]
        kill_and_await_restart(ray, victim)
        gate.kill_done.remote()
        written = [e for episodes in ray.get(runs) for e in episodes]

        assert episodes_before > 0
        rows = store.to_arrow()
        obs = np.stack(rows.column("obs").to_numpy(zero_copy_only=False))
        first = rows.column("step").to_numpy() == 0
        stored = sorted(tuple(int(v) for v in row[:3]) for row in obs[first])
        assert stored == sorted(written)   # every episode once: none lost, none twice
        batch = store.sample(256)
        np.testing.assert_array_equal(batch["next", "obs"][:, 3].numpy(), batch["obs"][:, 3].numpy() + 1)

        # A save compacts every shard's log into its durable checkpoint, which a restart then loads.
        store.save(tmp_path / "saved")
        for shard in ("shard-0", "shard-1"):
            assert (tmp_path / shard / "checkpoint" / "manifest.json").exists()
            assert len(list((tmp_path / shard).glob("log-*.arrowlog"))) == 1
        kill_and_await_restart(ray, ray.get_actor(f"{store.name}:1", namespace="arrowbuf"))
        assert store.episodes().column("episode_id").to_pylist() == rows_ids(rows)
    finally:
        store.close()


def test_durable_arguments_are_checked_before_any_shard_starts():
    from arrowbuf import RayOptions

    with pytest.raises(ValueError, match=r"durable must be True, False or a directory path, got 5"):
        ab.ExperienceStore(100, backend="ray", durable=5)
    assert durable_directory(True, "s") == Path.home() / ".cache" / "arrowbuf" / "s"
    assert durable_directory("~/logs", "s") == Path.home() / "logs" and durable_directory(False, "s") is None
    with pytest.raises(ValueError, match=r"durable=True needs backend='ray'"):
        ab.ExperienceStore(100, durable=True)
    with pytest.raises(ValueError, match=r"durable=True keeps the shards' logs in ~/.cache/arrowbuf/<name>: pass name="):
        ab.ExperienceStore(100, backend="ray", durable=True)   # refused before any actor starts
    with pytest.raises(ValueError, match=r"RayOptions.max_restarts must be an int >= -1, got -2"):
        RayOptions(max_restarts=-2)
    with pytest.raises(ValueError, match=r"RayOptions.durable_sync must be True or False, got 'no'"):
        RayOptions(durable_sync="no")



def test_a_clear_logged_before_an_episode_inserted_before_it_replays_after_that_episode(tmp_path, ray_cluster,
                                                                                      monkeypatch):
    # A rate limiter makes shard actors threaded: clear() (default group) runs beside
    # add_episodes (write group), and can fall between an episode's insert and its log
    # record. The restart replayed the clear too early (skipped it) and brought the
    # cleared episodes back.
    import threading

    from arrowbuf.ray.actor import ShardServer

    server = ShardServer(200, 0, 1, 0, ab.UniformSampler(), ab.MinSize(1), EPISODE_SCHEMA.to_json(), "circular",
                         durable=str(tmp_path / "shard-0"))
    first, schema = read_episode(make_episode(0, 5), EPISODE_SCHEMA, "env-1", None)
    server.add_episodes([first], schema.to_json())
    in_commit, release = threading.Event(), threading.Event()
    commit = server.durable.commit

    def slow_commit(*args, **kwargs):
        in_commit.set()
        assert release.wait(10)
        return commit(*args, **kwargs)

    monkeypatch.setattr(server.durable, "commit", slow_commit)
    second, _ = read_episode(make_episode(1, 5), EPISODE_SCHEMA, "env-1", None)
    writing = threading.Thread(target=server.add_episodes, args=([second], schema.to_json()))
    writing.start()
    assert in_commit.wait(10)            # inserted, not logged yet
    server.clear()                        # logged now, before it
    release.set()
    writing.join(10)
    third, _ = read_episode(make_episode(2, 5), EPISODE_SCHEMA, "env-1", None)
    monkeypatch.setattr(server.durable, "commit", commit)
    server.add_episodes([third], schema.to_json())
    server.durable.close()
    assert contents(server.engine) == {2: 2}
    restarted = recovered(tmp_path / "shard-0")
    assert contents(restarted) == {2: 2}   # the restart holds what the shard held
    assert restarted.table.col("first_index").tolist() == server.engine.table.col("first_index").tolist()


def test_a_clear_after_an_insert_whose_write_was_never_logged_still_clears_at_a_restart(tmp_path):
    # The shard died between the insert and its log record (the write was never answered),
    # after a clear logged with the next id past it.
    engine = new_engine()
    with DurableShard(tmp_path) as durable:
        write(durable, engine, [0])
        episode, schema = read_episode(make_episode(1, 5), EPISODE_SCHEMA, "env-1", None)
        engine.add(episode, schema)          # never logged
        engine.clear()
        durable.cleared(engine)
    assert contents(recovered(tmp_path)) == {}


def test_a_reader_that_meets_blocks_of_a_restarted_shard_reads_its_manifest_again(tmp_path, ray_cluster):
    # The first sample after the restart raised Ray's OwnerDiedError: this process still
    # held blocks owned by the killed actor process. A retry half a second later worked.
    ray = ray_cluster
    store = ab.ExperienceStore(2_000, backend="ray", num_shards=2, seed=0, durable=tmp_path)
    try:
        for tag in range(20):
            store.add_episode(make_episode(tag, 5), env_id=f"env-{tag}")
        store.flush()   # this process holds the shards' manifests (no sample taken yet)
        held = [block.ref for block in store._backend._reader.views[0].blocks]   # owned by shard 0's process
        ray.kill(ray.get_actor(f"{store.name}:0", namespace="arrowbuf"), no_restart=False)
        deadline = time.monotonic() + 60
        while store.episodes().num_rows < 20:   # until the restarted shard answers with every episode
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while True:   # until this process knows the old blocks' owner is gone (else the race hides it)
            try:
                ray.get(held[0], timeout=10)
            except ray.exceptions.ObjectLostError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        batch = store.sample(256)
        assert sorted(set(batch["obs"][:, 0].numpy().astype(int).tolist())) == list(range(20))
        # A shard that stays down is a ShardError, not one of Ray's errors.
        victim = ray.get_actor(f"{store.name}:1", namespace="arrowbuf")
        ray.kill(victim)   # no restart
        deadline = time.monotonic() + 60   # samples draw from the blocks held here until a manifest poll fails
        with pytest.raises(ab.ShardError, match=r"shard 1 of store"):
            while time.monotonic() < deadline:
                store.sample(256)
                time.sleep(0.05)
    finally:
        store.close()


@pytest.mark.usefixtures("ray_session")
def test_a_share_the_disk_refuses_is_not_taken(tmp_path, monkeypatch):
    """A durable shard keeps its share of the capacity on disk; when that write fails the shard
    raises and stays at the share its store knows (before, it held the new one while the store,
    which never got an answer, kept the old)."""
    from arrowbuf.durable import DurableShard
    from arrowbuf.ray.actor import ShardServer

    server = ShardServer(200, 0, 1, 3, ab.UniformSampler(), ab.RateLimiter(), EPISODE_SCHEMA.to_json(), "circular",
                         durable=str(tmp_path), blocks=(64 << 20, 3600.0))
    episodes = [read_episode(make_episode(tag, 9), EPISODE_SCHEMA)[0] for tag in range(12)]
    server.add_episodes(episodes, EPISODE_SCHEMA.to_json(), None, ("driver-a", 1))

    def full(self, capacity):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DurableShard, "remember_share", full)
    with pytest.raises(OSError, match="No space"):
        server.set_capacity(50)
    assert server.engine.capacity == 200 and server.durable.saved_share() is None
    assert len(server.engine) <= 50   # what the smaller share evicted stays gone
    monkeypatch.undo()
    assert server.set_capacity(150)[0] == 150 and server.durable.saved_share() == 150
    # The share file moved in place, then the directory's fsync failed (a reviewer's case): the file
    # is put back to the share the shard keeps, so that a restart takes what the store knows.
    import arrowbuf.durable as durable

    def fsync_fails(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(durable, "fsync", fsync_fails)
    with pytest.raises(OSError, match="Input/output"):
        server.set_capacity(60)
    monkeypatch.undo()
    assert server.engine.capacity == 150 and server.durable.saved_share() == 150
    server.durable.close()
