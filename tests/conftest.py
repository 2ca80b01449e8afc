"""Fixtures and hooks of the arrowbuf tests; the fakes, models and checks they share are in `support/`."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# The checks in support/ are plain asserts: rewrite them like a test's, for their messages.
pytest.register_assert_rewrite("support")

import arrowbuf as ab  # noqa: E402
from support.episodes import ExpectedEpisode, make_episode  # noqa: E402
from support.ring import RingModel  # noqa: E402

# CI (CI=true) replays the same examples every run and tolerates slow data generation
# on a loaded 2-core box; locally hypothesis explores new examples each run.
settings.register_profile("ci", derandomize=True, suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("CI"):
    settings.load_profile("ci")


#: The files of 5 s or more, longest first (summed durations of a full run, 2026-12-07, once the Ray
#: tests shared their stores), run first: pytest-xdist hands whole files (``--dist loadfile``) to
#: whichever worker is free, in collection order (with ``--no-loadscope-reorder``: xdist otherwise puts
#: the files with the most tests first), so starting with the longest keeps one worker from running a
#: long file alone at the end.
LONGEST_FIRST = ("test_ray_backend.py", "test_ray_dataplane.py", "test_bench_workloads.py", "test_corruption.py",
                 "test_notebooks.py", "test_docs.py", "test_ray_lent_blocks.py", "test_capacity.py", "test_ray_parity.py",
                 "test_contract.py", "test_ray_onramps.py", "test_ray_piece_cutting.py", "test_writer_cases.py",
                 "test_bench.py", "test_dataset.py", "test_ray_piece_reads.py", "test_bench_columns.py",
                 "test_compat_boundaries.py", "test_round_trips.py", "test_input_table.py", "test_durable.py", "test_gpu_check.py", "test_compat_refs.py",
                 "test_compat_engines.py", "test_ray_priorities.py", "test_ring_occupancy.py", "test_lazy_torch.py",
                 "test_durable_damage.py", "test_pieces.py", "test_ray_ragged.py", "test_cli.py",
                 "test_ray_writer_lifetime.py", "test_layers.py", "test_ray_reader_loop.py", "test_versions.py",
                 "test_encoded.py", "test_versions_ray.py", "test_ray_writers.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order


def pytest_configure(config: pytest.Config) -> None:
    # When a property fails, hypothesis imports libcst to suggest an @example patch;
    # libcst uses the deprecated mypy_extensions.TypedDict, and with warnings as
    # errors that turns a failing test into a pytest INTERNALERROR.
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


@pytest.fixture
def filled_store() -> tuple[ab.ExperienceStore, RingModel]:
    """A circular store of 30 transitions that has wrapped and evicted, with its model."""
    store = ab.ExperienceStore(capacity=30, seed=7)
    model = RingModel(30)
    for tag, (steps, has_final) in enumerate([(6, True), (9, True), (4, False), (12, True), (7, True), (5, True)]):
        store.add_episode(make_episode(tag, steps, has_final))
        model.add(ExpectedEpisode(tag, steps, has_final, terminated=True))
    return store, model


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session (2 CPUs, like CI)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_stores(ray_session):
    """The Ray stores the tests of one module share, one per configuration (`support.ray_stores`):
    each Ray store starts a process per shard."""
    from support.ray_stores import SharedStores

    shared = SharedStores()
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def fake_train_workers(ray_session):
    """Two RLightning-like train worker actors (`support.compat_envs.fake_train_worker`), shared by the
    compat tests: each call of theirs replaces the batch the worker holds, so no test sees another's,
    and the session starts their processes once."""
    import ray

    from support.compat_envs import fake_train_worker

    workers = [ray.remote(num_cpus=0)(fake_train_worker()).remote() for _ in range(2)]
    yield workers
    for worker in workers:
        ray.kill(worker)
