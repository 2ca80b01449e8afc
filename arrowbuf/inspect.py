"""Look at stored episodes: summaries and matplotlib figures for notebooks and the CLI.

Every function takes a *source*: an `ExperienceStore`, the directory of a Parquet
export (``store.to_parquet``) or of a checkpoint (``store.save``). Plots return a
`matplotlib.figure.Figure`: a notebook shows it, ``fig.savefig("out.png")`` writes
it. Figures are rendered with the non-interactive Agg backend and are not
registered with pyplot, so they work without a display, never open windows, are
shown once (not twice) in notebooks, and are freed with their last reference.

Example:
    >>> import numpy as np, arrowbuf as ab
    >>> from arrowbuf.inspect import plot_returns
    >>> store = ab.ExperienceStore(capacity=100, seed=0)
    >>> for k in range(3):
    ...     _ = store.add_episode({"obs": np.zeros((5, 2)), "reward": np.full(4, k),
    ...                            "terminated": np.arange(4) == 3})
    >>> [len(line.get_ydata()) for line in plot_returns(store).axes[0].lines]
    [3, 3]
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf._checks import check_int
from arrowbuf._persist import CHECKPOINT_MANIFEST, EXPORT_MANIFEST
from arrowbuf._stats import schema_rows
from arrowbuf.errors import FormatError
from arrowbuf.fields import arrow_to_numpy
from arrowbuf.schema import column_rows
from arrowbuf.store import ExperienceStore

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from arrowbuf.parquet import Export

__all__ = ["plot_episode", "plot_frames", "plot_lengths", "plot_returns", "plot_summary", "print_summary",
           "summarize"]

_ROLE = b"arrowbuf.role"
_FILES_SHOWN = 12


# -- loading -----------------------------------------------------------------------------


def _open(source: Any) -> ExperienceStore | Export:
    """The store itself, the store of a checkpoint, or a checked Parquet export."""
    if isinstance(source, ExperienceStore):
        return source
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be an ExperienceStore or the path of an export or checkpoint, "
                        f"got {type(source).__name__}")
    path = Path(source)
    if (path / EXPORT_MANIFEST).is_file():
        from arrowbuf.parquet import open_export

        return open_export(path)
    if (path / CHECKPOINT_MANIFEST).is_file():
        return ExperienceStore.load(path)
    raise FormatError(f"{path}: neither a Parquet export (no {EXPORT_MANIFEST}) nor a checkpoint "
                      f"(no {CHECKPOINT_MANIFEST}); pass a directory written by to_parquet or save")


def _episodes_of(source: Any) -> pa.Table:
    """The episode table of a source, in insertion order (across shards too)."""
    return _episode_table(_open(source))


def _episode_table(opened: ExperienceStore | Export) -> pa.Table:
    table = opened.episodes() if isinstance(opened, ExperienceStore) else opened.episodes
    return table.sort_by([("inserted_at", "ascending"), ("episode_id", "ascending")])


def _episode_rows(source: Any, episode_id: int) -> tuple[pa.Table, bool]:
    """One episode's rows (tensor columns, roles in the field metadata) and whether
    its last row is the final observation only.

    Raises:
        KeyError: no episode of this id in the source.
    """
    opened = _open(source)
    if isinstance(opened, ExperienceStore):
        batch = opened.episode(episode_id)
        return pa.Table.from_batches([batch]), batch.schema.metadata.get(b"arrowbuf.has_final") == b"1"
    import pyarrow.compute as pc

    from arrowbuf.parquet import read_parquet

    episodes = opened.episodes.filter(pc.field("episode_id") == episode_id)
    if not episodes.num_rows:
        raise KeyError(f"episode {episode_id!r} is not in {opened.path} "
                       f"({opened.episodes.num_rows} episodes; see its episodes.parquet)")
    rows = read_parquet(opened.path).to_table(filter=pc.field("episode_id") == episode_id)
    return rows, bool(episodes.column("has_final")[0].as_py())


def summarize(source: Any) -> dict[str, Any]:
    """What a source holds: kind, schema, rows, transitions, episodes, return and
    length statistics (mean / min / max over episodes) and, for directories, files.

    Raises:
        FormatError: a path that is not a complete export or checkpoint.
    """
    opened = _open(source)
    episodes = _episode_table(opened)
    schema = opened.schema
    kind = "store" if isinstance(source, ExperienceStore) else (
        "checkpoint" if isinstance(opened, ExperienceStore) else "parquet export")
    summary: dict[str, Any] = {
        "kind": kind, "schema": schema, "episodes": episodes.num_rows,
        "rows": int(np.sum(episodes.column("num_rows").to_numpy())),
        "transitions": int(np.sum(episodes.column("length").to_numpy())),
        "return": _describe(episodes.column("return").to_numpy()),
        "length": _describe(episodes.column("length").to_numpy()),
    }
    if kind != "store":
        root = Path(source)
        summary["files"] = [(str(p.relative_to(root)), p.stat().st_size)
                            for p in sorted(root.rglob("*")) if p.is_file()]
    return summary


def print_summary(source: Any, console: Any = None) -> dict[str, Any]:
    """Print `summarize` as rich tables (`arrowbuf inspect`); returns the summary."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console if console is not None else Console()
    summary = summarize(source)
    where = "" if summary["kind"] == "store" else f" {escape(str(source))}"
    console.print(f"[bold]{summary['kind']}{where}[/bold]: {summary['episodes']:,} episodes, "
                  f"{summary['rows']:,} rows, {summary['transitions']:,} transitions", soft_wrap=True)
    schema = Table("field", "dtype", "shape", "role", title="schema", title_justify="left")
    for row in schema_rows(summary["schema"]) if summary["schema"] is not None else []:
        schema.add_row(*row)
    stats = Table("per episode", "mean", "min", "max", title="episode statistics", title_justify="left")
    for name in ("return", "length"):
        stats.add_row(name, *(f"{summary[name][k]:.2f}" for k in ("mean", "min", "max")))
    console.print(schema, stats)
    if "files" in summary:
        files = Table("file", "bytes", title="files", title_justify="left")
        shown = summary["files"][:_FILES_SHOWN]
        for name, size in shown:
            files.add_row(name, f"{size:,}")
        if len(summary["files"]) > len(shown):
            files.add_row(f"... {len(summary['files']) - len(shown)} more", "")
        files.add_row("[bold]total[/bold]", f"[bold]{sum(size for _, size in summary['files']):,}[/bold]")
        console.print(files)
    return summary


def _describe(values: np.ndarray) -> dict[str, float]:
    values = values[~np.isnan(values)] if values.dtype.kind == "f" else values
    if not len(values):
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}


# -- figures -----------------------------------------------------------------------------


def _figure(**kwargs: Any) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("arrowbuf.inspect plots need matplotlib: pip install 'arrowbuf[plot]' "
                          "(or pip install matplotlib)") from None
    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _draw_returns(ax: Any, episodes: pa.Table, window: int) -> None:
    returns = episodes.column("return").to_numpy()
    x = np.arange(len(returns))
    ax.plot(x, returns, lw=0.8, alpha=0.5, label="return")
    ax.plot(x, _moving_average(returns, window), lw=2, label=f"mean of last {window}")
    ax.set(xlabel="episode (insertion order)", ylabel="return", title="episode returns")
    ax.legend(loc="best", fontsize="small")


def _draw_lengths(ax: Any, episodes: pa.Table, bins: int) -> None:
    ax.hist(episodes.column("length").to_numpy(), bins=bins)
    ax.set(xlabel="length (transitions)", ylabel="episodes", title="episode lengths")


def plot_returns(source: Any, window: int = 20) -> Figure:
    """Episode returns in insertion order, with their moving average over ``window`` episodes.

    The axis holds two lines of one point per episode: the returns and the average.
    """
    window = check_int("window", window, 1)
    figure = _figure(figsize=(6, 3.5), layout="constrained")
    _draw_returns(figure.add_subplot(), _episodes_of(source), window)
    return figure


def plot_lengths(source: Any, bins: int = 30) -> Figure:
    """A histogram of episode lengths (transitions) over ``bins`` bins."""
    bins = check_int("bins", bins, 1)
    figure = _figure(figsize=(6, 3.5), layout="constrained")
    _draw_lengths(figure.add_subplot(), _episodes_of(source), bins)
    return figure


def plot_summary(source: Any, window: int = 20, bins: int = 30) -> Figure:
    """Returns (with moving average) and the length histogram side by side (`arrowbuf inspect --plot`)."""
    window, bins = check_int("window", window, 1), check_int("bins", bins, 1)
    episodes = _episodes_of(source)
    figure = _figure(figsize=(10, 3.5), layout="constrained")
    returns_ax, lengths_ax = figure.subplots(1, 2)
    _draw_returns(returns_ax, episodes, window)
    _draw_lengths(lengths_ax, episodes, bins)
    figure.suptitle(f"{episodes.num_rows} episodes, {int(np.sum(episodes.column('length').to_numpy()))} transitions")
    return figure


def _traced_fields(rows: pa.Table) -> list[str]:
    """Default fields of `plot_episode`: numeric step fields of at most 8 values per step."""
    picked = []
    for field in rows.schema:
        role = (field.metadata or {}).get(_ROLE)
        if role != b"step" or pa.types.is_boolean(field.type):
            continue
        shape = field.type.shape if isinstance(field.type, pa.FixedShapeTensorType) else ()
        if math.prod(shape) <= 8:
            picked.append(field.name)
    return picked


def plot_episode(source: Any, episode_id: int, fields: Sequence[str] | None = None) -> Figure:
    """Per-step traces of one episode: one axis per field, one line per element.

    Args:
        source: a store, export or checkpoint directory.
        episode_id: the episode (an ``episode_id`` of the episode table).
        fields: the fields to draw; by default the numeric step fields with at most
            8 values per step (reward, action, log-prob, ...). Observation fields
            are drawn over every row, final observation included.

    Raises:
        KeyError: no such episode, or a field the rows do not have.
    """
    rows, has_final = _episode_rows(source, episode_id)
    names = list(fields) if fields is not None else _traced_fields(rows)
    unknown = [n for n in names if n not in rows.column_names]
    if unknown:
        raise KeyError(f"fields {unknown} are not columns of episode {episode_id}; it has {rows.column_names}")
    if not names:
        raise ValueError(f"episode {episode_id} has no numeric step field to draw; pass fields=[...] "
                         f"from {rows.column_names}")
    figure = _figure(figsize=(7, 1.2 + 1.6 * len(names)), layout="constrained")
    axes = figure.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    steps = arrow_to_numpy(rows.column("step"), "step")
    for ax, name in zip(axes, names):
        values = arrow_to_numpy(rows.column(name), name).astype(np.float64)
        observation = (rows.schema.field(name).metadata or {}).get(_ROLE) == b"observation"
        stop = len(values) - int(has_final and not observation)   # the final row holds only observations
        lines = ax.plot(steps[:stop], values[:stop].reshape(stop, -1), lw=1)
        ax.set_ylabel(name)
        if len(lines) > 1:
            ax.legend(lines, [f"{name}[{i}]" for i in range(len(lines))], fontsize="x-small",
                      loc="upper left", ncol=min(len(lines), 4))
    axes[-1].set_xlabel("step")
    figure.suptitle(f"episode {episode_id}")
    return figure


def plot_frames(source: Any, episode_id: int, field: str = "obs", max_frames: int = 16) -> Figure:
    """Frames of one episode's image observations (uint8 [H, W, C] or [H, W]) in a grid.

    At most ``max_frames`` frames, evenly spaced from the first to the last row,
    each titled with its step.

    Raises:
        KeyError: no such episode or field.
        ValueError: ``field`` does not hold uint8 images.
    """
    max_frames = check_int("max_frames", max_frames, 1)
    rows, _ = _episode_rows(source, episode_id)
    if field not in rows.column_names:
        raise KeyError(f"field {field!r} is not a column of episode {episode_id}; it has {rows.column_names}")
    frames = column_rows(rows.schema.field(field), rows.column(field))   # decoded, for an encoded field
    if frames.dtype != np.uint8 or not (frames.ndim == 3 or (frames.ndim == 4 and frames.shape[-1] in (1, 3, 4))):
        raise ValueError(f"field {field!r} holds {frames.dtype} of shape {frames.shape[1:]} per step; plot_frames "
                         "needs uint8 images [H, W] or [H, W, C] with C in (1, 3, 4)")
    steps = arrow_to_numpy(rows.column("step"), "step")
    picked = np.unique(np.linspace(0, len(frames) - 1, min(max_frames, len(frames))).round().astype(int))
    cols = min(len(picked), 8)
    grid_rows = -(-len(picked) // cols)
    height, width = frames.shape[1:3]
    figure = _figure(figsize=(1.6 * cols, 1.6 * grid_rows * height / width + 0.5), layout="constrained")
    gray = frames.ndim == 3 or frames.shape[-1] == 1
    for k, ax in enumerate(figure.subplots(grid_rows, cols, squeeze=False).ravel()):
        ax.set(xticks=[], yticks=[])   # keep the frame's border: renderings are often white
        if k >= len(picked):
            ax.set_axis_off()
        else:
            frame = frames[picked[k]]
            if gray:
                ax.imshow(frame.reshape(height, width), cmap="gray", vmin=0, vmax=255)
            else:
                ax.imshow(frame)
            ax.set_title(f"t={steps[picked[k]]}", fontsize="small")
    figure.suptitle(f"episode {episode_id}: {field}")
    return figure
