"""`Layout`: where each field and extra of one batch goes in its pooled slot (the one planner).

Both gathers plan their batches here: `arrowbuf.tensors.Gather` (an arena's rows)
and `arrowbuf.ray.gather.BlockGather` (a Ray reader's ordered block rows); a mixture's
batch stacks its sources' layouts into one slot (`stacked_slot`). A
layout depends on the batch's row shapes by role (step, observation, next
observation), the selected keys and the extras' names, dtypes and shapes; it is
planned once (`plan_layout`) and found again per batch (`Layouts.find`).

The slot holds, in order and each aligned to `ALIGN` bytes:

- every selected field (in the gatherer's order: schema order, an observation
  also as ``("next", ...)``), except those an extra of the same name replaces
  (n-step rewards);
- every extra (index, episode_id, step, weights, masks, n-step targets), its
  shape the batch's first axis then its own;
- past the leaves (no tensor views them), one region per group of row-packed
  small fields (`arrowbuf.packing`): a gather takes each group's records into
  its region, then copies every packed field out of them (`Layout.unpack`).

What a gatherer does with a layout's fields (bound takes of arena columns,
block-by-block reads of a ordering) is its own: it builds that once per layout
(`plan_layout`'s ``finish``) and keeps it in `Layout.fill`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from arrowbuf._pool import SlotSpec
from arrowbuf.packing import record_outs

ALIGN = 64  # bytes; keeps every view aligned for any dtype and for vector loads
#: A field's rows: 0 the transition's ("step"), 1 its observation rows (frame stacks
#: widen them: "obs"), 2 the observation after it ("next"); -1 marks an extra.
ROLES = ("step", "obs", "next")
#: Extras every batch has, whatever ``keys`` selects; naming them in ``keys`` is allowed.
ALWAYS = (("index",), ("episode_id",), ("step",))


class FieldPlan(NamedTuple):
    """A field as the planner sees it: its key, what the gatherer reads it from, its role
    index, dtype, shape of one row and the dtype name of its tensor (`SlotSpec.leaves`)."""

    key: tuple[str, ...]
    source: Any
    role: int
    dtype: np.dtype
    row_shape: tuple[int, ...]
    tensor_dtype: str


@dataclass(frozen=True, eq=False)   # hashed by identity: the pool's key, hashed per sample
class Layout:
    """Where everything of one batch layout goes in its slot (see the module docstring)."""

    # (field source, role index) per gathered field, then (extra name, -1) per extra:
    # the source of each of ``slot.leaves``, in order.
    plan: tuple[tuple[Any, int], ...]
    slot: SlotSpec
    # (dtype, shape past the batch axis) of each extra, in the order of the call's extras.
    extras: tuple[tuple[np.dtype, tuple[int, ...]], ...]
    copies: tuple[tuple[int, str], ...]              # (out position, extra name) per extra
    # (group, role index, out position of its records' region) per packed group with rows
    records: tuple[tuple[Any, int, int], ...]
    # (a packed field's out position, its strided view in the records) per packed field:
    # copied after the records are taken (`packing.record_outs`).
    unpack: tuple[tuple[int, int], ...]
    packed: frozenset                                # out positions of the packed fields
    reads_next: bool                                 # whether a field reads the next-observation rows
    fill: Any = None                                 # the gatherer's own plan (`plan_layout`'s ``finish``)


def plan_layout(fields: Iterable[FieldPlan], shapes: tuple, keys: frozenset | None, every_extra: tuple,
                pack: Callable[[list[FieldPlan]], Mapping[int, tuple[Any, int, int]]] | None = None,
                finish: Callable[[Layout], Any] | None = None) -> Layout:
    """The layout of a batch.

    Args:
        fields: every field the gatherer can gather, in order.
        shapes: the batch's row shapes by role (step, obs, next); None (obs, next):
            the step rows' shape.
        keys: the selected keys (`check_keys`; None: every field).
        every_extra: (name, dtype, shape) of each extra, in the call's order; an extra
            named like a field replaces it, so comes only with that field.
        pack: given the chosen fields, {their position: (group, record bytes, byte
            offset in a record)} of those gathered in row-packed records; a group is
            taken once into its records' region (by its members' role).
        finish: builds `Layout.fill` from the planned layout.
    """
    fields = list(fields)
    known = {f.key for f in fields}
    extras = [(name, dtype, shape) for name, dtype, shape in every_extra
              if keys is None or field_key(name) not in known or field_key(name) in keys]
    replaced = {field_key(name) for name, _, _ in extras}
    chosen = [f for f in fields if f.key not in replaced and (keys is None or f.key in keys)]
    plan, outs, leaves, total = [], [], [], 0

    def place(source: Any, role: int, key: tuple, dtype: np.dtype, tensor_dtype: str, shape: tuple) -> None:
        nonlocal total
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        plan.append((source, role))
        outs.append((dtype, shape, total))
        leaves.append((key, tensor_dtype, total, size, shape))
        total += -(-size // ALIGN) * ALIGN

    for f in chosen:
        place(f.source, f.role, f.key, f.dtype, f.tensor_dtype, tuple(_rows(shapes, f.role)) + tuple(f.row_shape))
    for name, dtype, shape in extras:
        place(name, -1, field_key(name), dtype, dtype.name, tuple(shape))
    groups: dict[int, list] = {}   # id(group) -> [group, record bytes, role, [(out position, offset)]]
    for position, (group, record_bytes, offset) in (pack(chosen) if pack is not None else {}).items():
        groups.setdefault(id(group), [group, record_bytes, chosen[position].role, []])[3].append((position, offset))
    records, unpack, packed = [], [], set()
    for group, record_bytes, role, members in groups.values():
        shape = tuple(_rows(shapes, role))
        rows = int(np.prod(shape, dtype=np.int64))
        if not rows:
            continue   # no rows: nothing to gather (and no region to place views in); the takes cost nothing
        records.append((group, role, len(outs)))
        unpack += record_outs(outs, total, shape, record_bytes, members)
        packed |= {position for position, _ in members}
        total += -(-rows * record_bytes // ALIGN) * ALIGN
    layout = Layout(tuple(plan), SlotSpec(max(total, 1), tuple(outs), tuple(leaves), tuple(shapes[0])),
                    tuple((dtype, tuple(shape[1:])) for _, dtype, shape in every_extra),
                    tuple((i, source) for i, (source, role) in enumerate(plan) if role < 0),
                    tuple(records), tuple(unpack), frozenset(packed), any(role == 2 for _, role in plan))
    return layout if finish is None else dataclasses.replace(layout, fill=finish(layout))


def stacked_slot(slots: Sequence[SlotSpec], counts: Sequence[int], extra: tuple[tuple[str, ...], np.dtype]
                 ) -> tuple[SlotSpec, list[tuple[int, int]]] | None:
    """One slot for several batches of the same fields stacked along the batch axis (a
    `arrowbuf.mixture.Mixture`'s batch, each source filling its share).

    Batch ``k`` has ``counts[k]`` rows laid out as ``slots[k]`` (a `Layout`'s slot). The
    stacked slot holds, each aligned to `ALIGN` bytes: every leaf with the rows of every
    batch back to back, then the ``extra`` leaf (its key and dtype, one value per row: which
    source a row came from), then each batch's scratch past its leaves (the regions of its
    packed records). Each batch's outs are moved to where its rows and scratch now lie.

    Returns:
        The slot, its outs batch 0's, batch 1's, ... then the extra leaf's, and the
        ``(start, stop)`` of each batch's outs in it; None when the batches' leaves differ
        (keys, dtypes, row shapes) or a leaf has rows of no bytes.
    """
    fields = [{key: (dtype, shape[1:], size // shape[0] if shape[0] else 0) for key, dtype, _, size, shape in spec.leaves}
              for spec in slots]
    if any(f != fields[0] for f in fields) or any(row == 0 for _, _, row in fields[0].values()):
        return None
    total_rows = sum(counts)
    offsets, leaves, total = {}, [], 0
    for key, dtype, _, _, shape in slots[0].leaves:
        row = fields[0][key][2]
        offsets[key] = total
        leaves.append((key, dtype, total, total_rows * row, (total_rows, *shape[1:])))
        total += _aligned(total_rows * row)
    extra_key, extra_dtype = extra
    leaves.append((extra_key, extra_dtype.name, total, total_rows * extra_dtype.itemsize, (total_rows,)))
    extra_offset = total
    total += _aligned(total_rows * extra_dtype.itemsize)
    outs: list[tuple] = []
    ranges = []
    first = 0
    for spec, count in zip(slots, counts):
        scratch = _aligned(max(offset + size for _, _, offset, size, _ in spec.leaves))
        base = total
        total += _aligned(max(spec.nbytes - scratch, 0))
        start = len(outs)
        for dtype, shape, offset, *strides in spec.outs:
            for key, _, leaf_offset, size, _ in spec.leaves:
                if leaf_offset <= offset < leaf_offset + size:
                    moved = offsets[key] + first * fields[0][key][2] + offset - leaf_offset
                    break
            else:
                moved = base + offset - scratch
            outs.append((dtype, shape, moved, *strides))
        ranges.append((start, len(outs)))
        first += count
    outs.append((extra_dtype, (total_rows,), extra_offset))
    return SlotSpec(max(total, 1), tuple(outs), tuple(leaves), (total_rows,)), ranges


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _rows(shapes: tuple, role: int) -> tuple[int, ...]:
    return shapes[0] if shapes[role] is None else shapes[role]


class Layouts:
    """The layouts of one gatherer, found by the shapes, the keys and the extras' names,
    then checked against the extras' dtypes and shapes (past the batch axis): building
    and hashing a key of every dtype and shape cost ~2.5 us a sample (W1), as much as
    three of its takes.

    Args:
        build: ``(shapes, keys, every_extra) -> Layout`` (`plan_layout` with the
            gatherer's fields), ``every_extra`` as `plan_layout` takes it.
    """

    def __init__(self, build: Callable[[tuple, frozenset | None, tuple], Layout]) -> None:
        self._build = build
        self._all: dict[tuple, Layout] = {}      # by shapes, keys and every extra's name, dtype and shape
        self._recent: dict[tuple, Layout] = {}   # by shapes, keys and extras' names: the last one used

    def find(self, shapes: tuple, keys: frozenset | None, extra: Mapping[str, np.ndarray]) -> Layout:
        """The layout of a batch of row shapes ``shapes`` (by role), ``keys`` and ``extra``
        (arrays whose first axis is the batch's, or a longer one that holds it)."""
        key = (shapes, keys, *extra)
        layout = self._recent.get(key)
        if layout is None or not matches(layout.extras, extra):
            full = (shapes, keys, *[(name, value.dtype, value.shape[1:]) for name, value in extra.items()])
            layout = self._all.get(full)
            if layout is None:
                count = shapes[0][0]
                layout = self._all[full] = self._build(
                    shapes, keys, tuple((name, dtype, (count, *tail)) for name, dtype, tail in full[2:]))
            self._recent[key] = layout
        return layout


def matches(expected: tuple, extra: Mapping[str, np.ndarray]) -> bool:
    """Whether the extras have the (dtype, shape past the batch axis)s of a layout's, in order."""
    for (dtype, shape), value in zip(expected, extra.values()):
        # `is` first: arrays of a builtin dtype share its one descriptor, and `!=` on
        # dtypes costs ~0.1 us each.
        if (value.dtype is not dtype and value.dtype != dtype) or value.shape[1:] != shape:
            return False
    return True


def check_keys(keys: Any, fields: Iterable[tuple[str, ...]]) -> frozenset | None:
    """The keys of ``fields`` that ``keys`` selects (None: all), checked before anything is drawn.

    Args:
        keys: names (a dotted name nests: "obs.pixels") or key tuples
            (``("next", "obs")``); a key that prefixes others selects them all
            (``("next",)``: every next observation). ``"index"``, ``"episode_id"``
            and ``"step"`` are always gathered.
        fields: the gathered keys.

    Raises:
        ValueError: ``keys`` is not a collection of keys, or names a key that is not gathered.
    """
    if keys is None or isinstance(keys, frozenset):
        return keys
    if isinstance(keys, (str, bytes, tuple)) or not isinstance(keys, Iterable):
        raise ValueError(f"keys must be a list of keys (names or key tuples), got {keys!r}; "
                         f"for one key pass [{keys!r}]")
    fields = list(fields)
    selected = set()
    for key in keys:
        path = field_key(key) if isinstance(key, str) else key
        if not (isinstance(path, tuple) and path and all(isinstance(part, str) for part in path)):
            raise ValueError(f"keys: {key!r} is not a key (a name or a tuple of names)")
        found = {field for field in fields if field[:len(path)] == path}
        if not found and path not in ALWAYS:
            raise ValueError(f"keys: no field {key!r}; available: {available_keys(fields)}")
        selected |= found
    return frozenset(selected)


def schema_keys(schema: Any) -> list[tuple[str, ...]]:
    """The keys a store of ``schema`` gathers (what ``keys`` may name, besides `ALWAYS`): each
    field's, and ``("next", ...)`` of each observation field, as the gathers lay them out."""
    keys = []
    for name, f in schema.fields.items():
        keys.append(field_key(name))
        if f.observation:
            keys.append(("next", *field_key(name)))
    return keys


def available_keys(fields: Iterable[tuple[str, ...]]) -> list:
    """Every key ``keys`` can name: the fields (and their ``("next", ...)``), and the extras always there."""
    return [key[0] if len(key) == 1 else key for key in [*fields, *ALWAYS]]


@functools.lru_cache(maxsize=None)
def field_key(name: str) -> tuple[str, ...]:
    """A dotted name as a TensorDict key path: "next.obs" -> ("next", "obs")."""
    return tuple(name.split("."))

