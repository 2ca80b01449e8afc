"""Inspection: plots of real CartPole episodes from stores, exports and checkpoints,
the summary, and the store's reuse / priority statistics and notebook HTML."""

from __future__ import annotations

import io
import sys

import numpy as np
import pyarrow.compute as pc
import pytest
from matplotlib.image import AxesImage

import arrowbuf as ab
from arrowbuf.inspect import (_episode_rows, plot_episode, plot_frames, plot_lengths, plot_returns, plot_summary,
                              summarize)

from support.envs import FRAME_SHAPE, cartpole_store, pixel_store


SOURCES = ("store", "export", "checkpoint")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One CartPole store, its Parquet export and its checkpoint."""
    store = cartpole_store(steps=600)
    root = tmp_path_factory.mktemp("inspect")
    return {"store": store, "export": store.to_parquet(root / "export", progress=False),
            "checkpoint": store.save(root / "checkpoint", progress=False)}


@pytest.fixture(scope="module")
def pixels():
    return pixel_store(episodes=2)


def _png_size(figure) -> int:
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=40)
    return len(out.getvalue())


# -- plots -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SOURCES)
def test_returns_plot_draws_every_return_and_their_moving_average(sources, kind):
    episodes = sources["store"].episodes()
    returns = episodes.column("return").to_numpy()
    axes = plot_returns(sources[kind], window=5).axes
    assert len(axes) == 1 and len(axes[0].lines) == 2
    raw, average = axes[0].lines
    assert len(raw.get_ydata()) == len(average.get_ydata()) == episodes.num_rows > 10
    np.testing.assert_allclose(raw.get_ydata(), returns)
    np.testing.assert_allclose(average.get_ydata()[-1], returns[-5:].mean())
    np.testing.assert_allclose(average.get_ydata()[0], returns[0])


@pytest.mark.parametrize("kind", SOURCES)
def test_lengths_plot_is_a_histogram_of_every_episode(sources, kind):
    lengths = sources["store"].episodes().column("length").to_numpy()
    (ax,) = plot_lengths(sources[kind], bins=7).axes
    heights = [patch.get_height() for patch in ax.patches]
    assert len(heights) == 7 and sum(heights) == len(lengths)


def test_summary_plot_has_the_returns_and_the_lengths_side_by_side(sources):
    figure = plot_summary(sources["export"])
    returns_ax, lengths_ax = figure.axes
    assert len(returns_ax.lines) == 2 and len(returns_ax.lines[0].get_ydata()) == sources["store"].num_episodes
    assert sum(p.get_height() for p in lengths_ax.patches) == sources["store"].num_episodes
    assert _png_size(figure) > 0


@pytest.mark.parametrize("kind", SOURCES)
def test_episode_plot_has_one_axis_per_step_field_with_its_values(sources, kind):
    store = sources["store"]
    episode_id = int(store.episodes().column("episode_id")[3].as_py())
    rows = store.episode(episode_id)
    steps = len(rows) - 1   # the last row holds only the final observation
    axes = plot_episode(sources[kind], episode_id).axes
    assert [ax.get_ylabel() for ax in axes] == ["action", "reward"]
    (action,), (reward,) = (ax.lines for ax in axes)
    np.testing.assert_array_equal(action.get_ydata(), rows.column("action").to_numpy()[:steps])
    np.testing.assert_array_equal(reward.get_ydata(), rows.column("reward").to_numpy()[:steps])
    assert list(action.get_xdata()) == list(range(steps))


def test_episode_plot_draws_one_line_per_observation_element_over_every_row(sources):
    store = sources["store"]
    episode_id = int(store.episodes().column("episode_id")[0].as_py())
    obs_ax, reward_ax = plot_episode(store, episode_id, fields=["obs", "reward"]).axes
    rows = len(store.episode(episode_id))
    assert len(obs_ax.lines) == 4 and all(len(line.get_ydata()) == rows for line in obs_ax.lines)
    assert len(reward_ax.lines) == 1 and len(reward_ax.lines[0].get_ydata()) == rows - 1


@pytest.mark.parametrize("kind", ("store", "export"))
def test_an_unknown_episode_or_field_raises_key_error(sources, kind):
    with pytest.raises(KeyError, match="episode 999999"):
        plot_episode(sources[kind], 999_999)
    with pytest.raises(KeyError, match="'nope'"):
        plot_episode(sources[kind], 0, fields=["nope"])


def test_frames_plot_shows_evenly_spaced_frames_of_one_episode(pixels, tmp_path):
    episode_id = int(pixels.episodes().column("episode_id")[1].as_py())
    frames = pixels.episode(episode_id).column("obs").to_numpy_ndarray()
    assert frames.shape[1:] == FRAME_SHAPE and len(frames) > 6
    for source in (pixels, pixels.to_parquet(tmp_path / "pixels", progress=False)):
        figure = plot_frames(source, episode_id, max_frames=6)
        images = [ax.images[0] for ax in figure.axes if ax.images]
        assert len(images) == 6 and all(isinstance(image, AxesImage) for image in images)
        np.testing.assert_array_equal(images[0].get_array(), frames[0])
        np.testing.assert_array_equal(images[-1].get_array(), frames[-1])
        assert next(ax.get_title() for ax in figure.axes if ax.images) == "t=0"


def test_frames_plot_shows_every_frame_of_a_short_episode(pixels):
    episode_id = int(pixels.episodes().column("episode_id")[0].as_py())
    rows = len(pixels.episode(episode_id))
    figure = plot_frames(pixels, episode_id, max_frames=rows + 10)
    assert sum(bool(ax.images) for ax in figure.axes) == rows
    assert _png_size(figure) > 0


def test_frames_plot_refuses_a_field_that_is_not_an_image(sources):
    with pytest.raises(ValueError, match="'obs' holds float32 of shape \\(4,\\)"):
        plot_frames(sources["store"], 0)


def test_a_directory_that_is_neither_an_export_nor_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ab.FormatError, match="neither a Parquet export"):
        plot_returns(tmp_path)


def test_plots_without_matplotlib_say_how_to_install_it(sources, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'arrowbuf\[plot\]'"):
        plot_returns(sources["store"])


# -- summary -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", SOURCES)
def test_summary_counts_episodes_rows_and_return_statistics(sources, kind):
    episodes = sources["store"].episodes()
    summary = summarize(sources[kind])
    assert summary["episodes"] == episodes.num_rows
    assert summary["transitions"] == len(sources["store"])
    assert summary["rows"] == pc.sum(episodes.column("num_rows")).as_py()
    assert summary["return"]["mean"] == pytest.approx(pc.mean(episodes.column("return")).as_py())
    assert summary["length"]["max"] == pc.max(episodes.column("length")).as_py()
    assert ("files" in summary) == (kind != "store")


def test_episode_rows_of_an_export_equal_the_stored_episode(sources):
    episode_id = int(sources["store"].episodes().column("episode_id")[-1].as_py())
    rows, has_final = _episode_rows(sources["export"], episode_id)
    stored = sources["store"].episode(episode_id)
    assert has_final and rows.num_rows == len(stored)
    np.testing.assert_array_equal(rows.column("obs").combine_chunks().to_numpy_ndarray(),
                                  stored.column("obs").to_numpy_ndarray())


# -- stats: reuse and priorities ---------------------------------------------------------


def _fill(store: ab.ExperienceStore, episodes: int = 4, steps: int = 5) -> None:
    for k in range(episodes):
        store.add_episode({"obs": np.full((steps + 1, 2), k, np.float32), "action": np.zeros(steps),
                           "reward": np.ones(steps), "terminated": np.arange(steps) == steps - 1})


def test_one_epoch_without_replacement_samples_every_live_transition_once():
    store = ab.ExperienceStore(100, seed=0, sampler=ab.WithoutReplacementSampler(), track_reuse=True)
    _fill(store)
    assert store.stats()["reuse"] == {"min": 0, "mean": 0.0, "max": 0}
    for size in (7, 7, 6):
        store.sample(size)
    assert store.stats()["reuse"] == {"min": 1, "mean": 1.0, "max": 1}


def test_reuse_counts_equal_the_counts_of_the_sampled_indices():
    store = ab.ExperienceStore(100, seed=0, track_reuse=True)
    _fill(store)
    index = np.concatenate([store.sample(16)["index"].numpy() for _ in range(10)])
    counts = np.bincount(index, minlength=len(store))
    np.testing.assert_array_equal(store.engine.shard.reuse_counts(), counts)
    assert store.stats()["reuse"] == {"min": counts.min(), "mean": 160 / 20, "max": counts.max()}


def test_an_on_policy_epoch_counts_each_transition_once():
    store = ab.ExperienceStore(100, seed=0, track_reuse=True)
    _fill(store)
    assert sum(len(batch) for batch in store.iter_batches(6)) == 20
    assert store.stats()["reuse"] == {"min": 1, "mean": 1.0, "max": 1}


def test_padding_of_sequences_is_not_counted_as_a_sample():
    store = ab.ExperienceStore(100, seed=0, sampler=ab.SequenceSampler(4, strict=False), track_reuse=True)
    _fill(store)
    batch = store.sample(32)
    assert store.engine.shard.reuse_counts().sum() == int(batch["mask"].sum()) < 32 * 4


def test_rows_rewritten_by_new_episodes_start_unsampled():
    store = ab.ExperienceStore(15, seed=0, sampler=ab.WithoutReplacementSampler(), track_reuse=True)   # transitions
    _fill(store, episodes=3)
    store.sample(15)
    _fill(store, episodes=1)   # evicts the oldest episode, reuses its rows
    assert store.stats()["reuse"] == {"min": 0, "mean": 10 / 15, "max": 1}
    np.testing.assert_array_equal(store.engine.shard.reuse_counts(), [1] * 10 + [0] * 5)


def test_reuse_is_only_tracked_when_asked_for():
    store = ab.ExperienceStore(100, seed=0)
    _fill(store)
    store.sample(8)
    assert store.stats()["reuse"] is None and store.engine.shard.reuse is None
    with pytest.raises(ValueError, match="track_reuse must be True or False, got 1"):
        ab.ExperienceStore(100, track_reuse=1)


def test_priority_histogram_counts_live_priorities_in_log_spaced_bins():
    store = ab.ExperienceStore(100, seed=0, sampler=ab.PrioritizedSampler(alpha=0.5, eps=1e-6))
    _fill(store)
    index = np.arange(20)
    store.update_priorities(index, np.repeat([1e-3, 1e-1, 10.0, 1000.0], 5))
    histogram = store.stats()["priorities"]
    edges = np.array(histogram["edges"])
    assert sum(histogram["counts"]) == 20 and len(edges) == 11
    np.testing.assert_allclose(np.diff(np.log(edges)), np.log(edges[1] / edges[0]))
    assert edges[0] == pytest.approx(1e-3 + 1e-6) and edges[-1] == pytest.approx(1000 + 1e-6)
    assert histogram["counts"][0] == 5 and histogram["counts"][-1] == 5
    assert ab.ExperienceStore(100).stats()["priorities"] is None


def test_priority_histogram_of_equal_priorities_is_one_bin():
    store = ab.ExperienceStore(100, seed=0, sampler=ab.PrioritizedSampler())
    _fill(store)
    assert store.stats()["priorities"] == {"edges": [1.0, 1.0], "counts": [20]}


def test_the_notebook_view_of_a_store_shows_its_schema_and_stats():
    store = ab.ExperienceStore(100, seed=0, track_reuse=True)
    assert "none yet" in store._repr_html_()
    _fill(store)
    store.sample(4)
    page = store._repr_html_()
    for text in ("<td>obs</td><td>float32</td><td>(2,)</td><td>observation</td>",
                 "<td>reward</td><td>float64</td><td>()</td><td>step</td>",
                 "<td>episode_id</td><td>int64</td><td>()</td><td>system</td>",
                 "<td>transitions</td><td>20</td>", "<td>reuse</td><td>min 0, mean 0.2, max"):
        assert text in page
