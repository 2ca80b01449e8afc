"""Durable directories under hostile hands: a second writer, damaged or deleted segments
(the newest included), names that would leave their directory, and who may read the data."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import arrowbuf as ab
from arrowbuf.durable import DurableShard, durable_directory
from arrowbuf.errors import FormatError, InUseError

from test_durable import contents, new_engine, recovered, write

INFO = {"capacity": 200, "mode": "circular", "seed": 3, "track_reuse": False, "created_at": 0.0}

HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_durable import new_engine, write
    from arrowbuf.durable import DurableShard

    durable = DurableShard(sys.argv[1])
    engine = durable.recover(new_engine)
    write(durable, engine, [7])
    print("holding", flush=True)
    time.sleep(600)
""")


def test_a_durable_directory_has_one_writer_at_a_time_and_a_killed_holder_leaves_nothing_to_clean_up(tmp_path):
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(tests)], stdout=subprocess.PIPE,
                          text=True, env=env) as holder:
        try:
            assert holder.stdout.readline().strip() == "holding"
            with pytest.raises(InUseError, match=rf"{tmp_path} is in use by process {holder.pid} on host "):
                DurableShard(tmp_path)
        finally:
            holder.send_signal(signal.SIGKILL)
    assert holder.returncode == -signal.SIGKILL
    # The OS released the lock with the process: no stale lock file to remove by hand.
    assert contents(recovered(tmp_path)) == {0: 7}
    with DurableShard(tmp_path):   # held again here: a second open, even in this process, is refused
        with pytest.raises(InUseError, match=rf"in use by process {os.getpid()} "):
            DurableShard(tmp_path)


def test_a_ray_store_on_a_durable_directory_in_use_raises_in_use_error_naming_the_holder(tmp_path, ray_session):
    first = ab.ExperienceStore(100, backend="ray", num_shards=1, durable=tmp_path)
    try:
        with pytest.raises(InUseError, match=rf"shard-0 is in use by process \d+ on host .*shard 0 of store "
                                             rf"{first.name!r}, started by pid {os.getpid()}"):
            ab.ExperienceStore(100, backend="ray", num_shards=1, durable=tmp_path)
    finally:
        first.close()   # releases the locks at once, not when the actor processes are gone
    second = ab.ExperienceStore(100, backend="ray", num_shards=1, durable=tmp_path)
    second.close()


def test_starting_a_store_under_a_running_name_raises_an_arrowbuf_error(ray_session):
    store = ab.ExperienceStore(100, backend="ray", num_shards=1, name="taken-name")
    try:
        with pytest.raises(InUseError, match=r"store name 'taken-name' is taken: shard actor\(s\) \[0\]"):
            ab.ExperienceStore(100, backend="ray", num_shards=1, name="taken-name")
        assert len(store) == 0   # the running store is untouched
    finally:
        store.close()


# -- damage to segments, the newest included ------------------------------------------


def damaged_log(directory: Path) -> tuple[list[Path], list[int]]:
    """A closed log of three segments of acknowledged episodes: the segments, and the byte
    where each record of the newest one ends."""
    durable = DurableShard(directory)
    engine = durable.recover(new_engine)
    write(durable, engine, [0, 1])
    durable.log.segment_bytes = 1   # each write now starts a new segment
    write(durable, engine, [2])
    write(durable, engine, [3])
    durable.log.segment_bytes = 1 << 30   # episodes 3 and 4 share the newest segment
    ends = [durable.log.segments()[-1].stat().st_size]
    write(durable, engine, [4])
    ends.append(durable.log.segments()[-1].stat().st_size)
    durable.close()
    segments = durable.log.segments()
    assert len(segments) == 3 and contents(recovered(directory)) == {i: i for i in range(5)}
    return segments, ends


def first_record_end(segment: Path) -> int:
    """Where a segment's first record (its start record) ends."""
    from arrowbuf._log_records import HEADER, HEADER_BYTES

    return HEADER_BYTES + HEADER.unpack_from(segment.read_bytes())[1]


DAMAGE = {
    "newest cut at a record boundary": lambda segs, ends: os.truncate(segs[-1], ends[0]),
    "newest cut inside its last record": lambda segs, ends: os.truncate(segs[-1], ends[1] - 7),
    "newest emptied": lambda segs, ends: os.truncate(segs[-1], 0),
    "newest deleted": lambda segs, ends: segs[-1].unlink(),
    "older cut at a record boundary": lambda segs, ends: os.truncate(segs[1], first_record_end(segs[1])),
    "older emptied": lambda segs, ends: os.truncate(segs[1], 0),
    "older deleted": lambda segs, ends: segs[1].unlink(),
    "oldest deleted": lambda segs, ends: segs[0].unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_to_any_segment_raises_format_error_naming_it_and_what_it_cannot_vouch_for(tmp_path, damage):
    segments, ends = damaged_log(tmp_path)
    DAMAGE[damage](segments, ends)
    named = segments[-1] if damage.startswith("newest") else segments[0] if damage.startswith("oldest") \
        else segments[1]
    with pytest.raises(FormatError, match=rf"{named.name}: .*cannot be vouched for"):
        with DurableShard(tmp_path) as durable:
            durable.recover(new_engine)
    assert all(p.exists() for p in segments if p != named)   # nothing was repaired away


def test_a_deleted_head_with_acknowledged_appends_raises_format_error(tmp_path):
    segments, _ = damaged_log(tmp_path)
    (tmp_path / "log-head").unlink()
    segments[-1].unlink()   # with the head gone too, nothing else would tell
    with pytest.raises(FormatError, match=r"log-head: missing \(deleted\)"):
        DurableShard(tmp_path)


def test_a_crash_torn_append_is_dropped_while_every_acknowledged_episode_is_recovered(tmp_path):
    # Crash mid-append: the record's bytes are cut, and the head was never moved past them
    # (it moves once the bytes are flushed, before the append returns).
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [0, 1])
    head = (tmp_path / "log-head").read_bytes()
    write(durable, engine, [2])
    durable.close()
    segment = durable.log.segments()[-1]
    os.truncate(segment, segment.stat().st_size - 40)
    (tmp_path / "log-head").write_bytes(head)
    assert contents(recovered(tmp_path)) == {0: 0, 1: 1}


def test_a_checkpoint_then_damage_to_the_segment_after_it_is_still_found(tmp_path):
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    write(durable, engine, [0, 1])
    durable.checkpoint(engine, INFO)
    write(durable, engine, [2])
    durable.close()
    os.truncate(durable.log.segments()[-1], 0)
    with pytest.raises(FormatError, match=r"episodes 2\.\.2 \(acknowledged; neither the readable records nor the "
                                          r"last checkpoint hold them\)"):
        DurableShard(tmp_path)


# -- names and permissions -------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "/tmp/elsewhere", "a/b", "..", "."])
def test_durable_names_that_could_leave_their_directory_are_refused(name):
    with pytest.raises(ValueError, match=rf"name {name!r} cannot name a durable directory"):
        durable_directory(True, name)
    with pytest.raises(ValueError, match=r"cannot name a durable directory"):
        ab.ExperienceStore(100, backend="ray", durable=True, name=name)   # refused before any actor starts
    assert durable_directory(True, "plain-name") == Path.home() / ".cache" / "arrowbuf" / "plain-name"


def test_durable_data_and_its_lock_are_readable_by_their_owner_only(tmp_path):
    previous = os.umask(0o022)   # the usual umask: without care files come out 0644, directories 0755
    try:
        durable = DurableShard(tmp_path / "shard-0")
        engine = durable.recover(new_engine)
        write(durable, engine, [0])
        durable.checkpoint(engine, INFO)
        write(durable, engine, [1])
        durable.close()
    finally:
        os.umask(previous)
    names = {p.name for p in (tmp_path / "shard-0").iterdir()}
    assert {"lock", "log-head", "checkpoint"} <= names
    for path in [tmp_path / "shard-0", *(tmp_path / "shard-0").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} is {oct(mode)}"
