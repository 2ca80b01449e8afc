"""Reading a writer's step: the arrays an env step returned, as columns checked against the schema.

`StepReader` turns one `arrowbuf.episodes.StepWriter.add` call's values (``obs``,
``next_obs``, the step fields, ``final_obs``) into columns of (array, dtype name),
inferring the schema before the first step and naming the field, the value and what
was expected when one does not match. Exact numpy steps take a fast path that skips
the checks' per-step cost; staging and sealing them is the writer's.

`check_obs_chain` refuses a mid-episode ``obs`` that differs from the env's last
``next_obs``: a writer stores each observation once (observation t + 1 is the
``next_obs`` of step t), so one of the two would be replaced.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from arrowbuf._lazy_torch import is_tensor
from arrowbuf.stage_arrays import host_copy, owned_copy, step_tensor
from arrowbuf.autoreset import same_rows
from arrowbuf.errors import ObservationMismatchError, SchemaError
from arrowbuf.fields import Field, as_array, check_column
from arrowbuf.schema import Schema, at_path, flatten, has_keys, key_counts
from arrowbuf.versions import as_version_schema, writer_fields

if TYPE_CHECKING:
    import torch


class StepReader:
    """Reads the steps of a writer of ``num_envs`` envs (staged on ``device``, in ``autoreset_mode``:
    None for a writer given no mode, whose `arrowbuf.autoreset.ResetCheck` reads its steps' resets)."""

    def __init__(self, num_envs: int, device: torch.device | None, autoreset_mode: str) -> None:
        self.num_envs = num_envs
        self.device = device
        self.autoreset_mode = autoreset_mode
        # (schema, torch imported, `_exact_specs` of them): the fast path's
        self._exact: tuple[Schema, bool, tuple | None] | None = None

    def read(self, schema: Schema | None, obs: Any, next_obs: Any, step: dict[str, Any]
             ) -> tuple[Schema, dict, dict, dict]:
        """The step's columns, checked against ``schema`` (the store's; inferred from them
        when None, before the first step): (schema, obs, next_obs, step columns), each
        column (array, dtype name).

        Raises:
            SchemaError: naming the field, the value received and what was expected.
        """
        exact = self._exact_step(schema, obs, next_obs, step)
        if exact is not None:
            return exact
        obs_cols = self._columns({"obs": obs}, "obs")
        next_cols = self._columns({"obs": next_obs}, "next_obs")
        step_cols = self._columns(step, "step")
        schema = self._schema_for(schema, obs_cols, step_cols)
        fields = writer_fields(schema)
        expected = {n: self.num_envs for n in fields}
        given = {n: a.shape[0] if a.ndim else None for n, (a, _) in {**obs_cols, **step_cols}.items()}
        if given != expected:
            missing = sorted(set(fields) - set(given))
            unknown = sorted(set(given) - set(schema.fields))
            wrong = {n: v for n, v in given.items() if n in expected and v != self.num_envs}
            raise SchemaError(f"writer step does not match the schema: missing {missing}, unknown {unknown}, "
                              f"leading dims {wrong} (expected {self.num_envs} envs)")
        for cols in (obs_cols, step_cols):
            for name, (array, dtype) in cols.items():
                check_column(schema.fields[name], name, array, dtype)
        self._check_fields(next_cols, obs_cols, "next_obs", schema, leading=1)
        return schema, obs_cols, next_cols, step_cols

    def _exact_step(self, schema: Schema | None, obs: Any, next_obs: Any, step: dict[str, Any]
                    ) -> tuple[Schema, dict, dict, dict] | None:
        """The fast path of `read`, as `Schema.read_exact` is a write's: the step's columns
        when ``obs`` and ``next_obs`` (an array, or dicts of exactly the observation fields)
        and ``step`` (exactly the other fields) hold numpy arrays or CPU tensors, each of its
        field's exact dtype and shape [num_envs, ...]; None for anything else (no schema yet,
        a dtype that casts, a CUDA tensor, a bad value...), and `read` then reads it and names
        any error. What it accepts, `read`'s general path accepts unchanged: it only skips the
        checks' per-step cost (~25 us of a W2 step's ~50; ~80 us of a torch step's ~190)."""
        if schema is None:
            return None
        tensors = "torch" in sys.modules   # else no value is a tensor, and torch stays unimported
        if self._exact is None or self._exact[0] is not schema or self._exact[1] is not tensors:
            self._exact = (schema, tensors, self._exact_specs(schema, tensors))
        specs = self._exact[2]
        if specs is None:
            return None
        obs_specs, groups, step_specs = specs
        if len(step) != len(step_specs):
            return None
        obs_cols, next_cols = _exact_obs(obs, obs_specs, groups), _exact_obs(next_obs, obs_specs, groups)
        if obs_cols is None or next_cols is None:
            return None
        step_cols = {}
        for name, dtype, tdtype, shape, dtype_name in step_specs:
            array = _exact_value(step.get(name), dtype, tdtype, shape)
            if array is None:
                return None
            step_cols[name] = (array, dtype_name)
        return schema, obs_cols, next_cols, step_cols

    def _exact_specs(self, schema: Schema, tensors: bool) -> tuple | None:
        """The fast path's specs: of the observation fields (name, path under ``obs``, numpy dtype
        (None for bfloat16: numpy has none), torch dtype (None where ``tensors`` is False: torch is not
        imported), step shape [num_envs, ...], dtype name),
        the number of keys of each dict under ``obs`` (none: ``obs`` is one array), then the step
        fields' (name, numpy dtype, torch dtype, step shape, dtype name); None when the fast path
        cannot apply (staging on a device, an observation named other than ``obs`` or ``obs.*``)."""
        fields = writer_fields(schema)
        names = schema.observation_names
        if self.device is not None or not all(n == "obs" or n.startswith("obs.") for n in names) \
                or ("obs" in names and len(names) > 1):
            return None

        def spec(name: str) -> tuple:
            f = fields[name]
            return (None if f.dtype == "bfloat16" else f.numpy_dtype, f.torch_dtype if tensors and not f.text else None,
                    (self.num_envs, *f.shape), f.dtype)

        obs_specs = tuple((name, tuple(name.split(".")[1:]), *spec(name)) for name in names)
        step_specs = tuple((name, *spec(name)) for name in fields if name not in names)
        return obs_specs, key_counts(spec[1] for spec in obs_specs), step_specs

    def _columns(self, data: Mapping[str, Any], what: str) -> dict[str, tuple[np.ndarray, str]]:
        try:
            if self.device is not None:
                return {name: step_tensor(value, name) for name, value in flatten(data).items()}
            return {name: as_array(value, name) for name, value in flatten(data).items()}
        except SchemaError as err:
            raise SchemaError(f"{what}: {err}") from None

    def _schema_for(self, schema: Schema | None, obs_cols: dict, step_cols: dict) -> Schema:
        if schema is None:
            columns = {**obs_cols, **step_cols}
            schema = as_version_schema(Schema.infer(columns, observation_names=list(obs_cols)))
        elif set(schema.observation_names) != set(obs_cols):
            raise SchemaError(f"obs has fields {sorted(obs_cols)}; the store's observation fields are "
                              f"{sorted(schema.observation_names)}")
        return schema

    def final_obs(self, final_obs: Any, next_cols: dict, done: np.ndarray, schema: Schema) -> dict[str, np.ndarray]:
        """The final observation of each env (read where ``done``): ``next_obs``, or in
        ``same_step`` mode the checked ``final_obs``.

        Raises:
            ValueError: ``same_step`` mode and an episode ends without ``final_obs``, or ``final_obs``
                given in another mode (dropped, it would store next_obs in its place).
            SchemaError: ``final_obs`` of other fields, dtypes or shapes than ``next_obs``.
        """
        if self.autoreset_mode != "same_step" and final_obs is not None and self.autoreset_mode is not None:
            raise ValueError(f"final_obs is for autoreset_mode='same_step' (envs that reset within the step); this "
                             f"writer is in {self.autoreset_mode!r} mode, where next_obs is the final observation "
                             "and final_obs would be dropped: open the writer with autoreset_mode='same_step'")
        if self.autoreset_mode != "same_step" or not done.any():
            return {n: a for n, (a, _) in next_cols.items()}
        if final_obs is None:
            raise ValueError("autoreset_mode='same_step' needs final_obs (info['final_obs']) on steps where an "
                             "episode ends")
        if isinstance(final_obs, np.ndarray) and final_obs.dtype == object:
            # gymnasium's info["final_obs"]: one observation per env, None where none ended.
            if final_obs.shape != (self.num_envs,):
                raise SchemaError(f"final_obs: object array of shape {final_obs.shape}; expected ({self.num_envs},), "
                                  "one entry per env")
            template = {n: owned_copy(a) for n, (a, _) in next_cols.items()}
            for i in np.flatnonzero(done):
                entry = self._columns({"obs": final_obs[i]}, f"final_obs[{i}]")
                self._check_fields(entry, template, f"final_obs[{i}]", schema, leading=0)
                for name in template:
                    template[name][i] = entry[name][0]
            return template
        cols = self._columns({"obs": final_obs}, "final_obs")
        self._check_fields(cols, next_cols, "final_obs", schema, leading=1)
        return {n: a for n, (a, _) in cols.items()}

    def _check_fields(self, cols: dict[str, tuple[np.ndarray, str]], expected: Mapping[str, Any], what: str,
                      schema: Schema, leading: int) -> None:
        """``cols`` hold exactly the observation fields, each of the schema's dtype
        and shape (after ``leading`` dims of ``num_envs``)."""
        if set(cols) != set(expected):
            raise SchemaError(f"{what} has fields {sorted(cols)}; expected the observation fields {sorted(expected)}")
        for name, (array, dtype) in cols.items():
            try:
                check_column(schema.fields[name], name, array, dtype, leading)
            except SchemaError as err:
                raise SchemaError(f"{what}: {err}") from None
            if leading and array.shape[0] != self.num_envs:
                raise SchemaError(f"{what} field {name!r}: leading dim {array.shape[0]}, expected {self.num_envs}")


def _exact_value(value: Any, dtype: np.dtype | None, tdtype: torch.dtype | None, shape: tuple[int, ...]
                 ) -> np.ndarray | None:
    """``value`` as the numpy array (a view) `read` would make of it, when it is a numpy array of
    ``dtype`` or a CPU tensor of ``tdtype`` (bfloat16: its uint16 bits), of ``shape``; else None."""
    kind = type(value)
    if kind is np.ndarray:
        return value if value.dtype == dtype and value.shape == shape else None
    if tdtype is None:   # a text field, or no tensor (torch not imported)
        return None
    torch = sys.modules["torch"]
    if kind is not torch.Tensor or value.dtype is not tdtype or not value.is_cpu or value.is_nested \
            or value.shape != shape:
        return None
    if value.requires_grad:
        value = value.detach()
    return value.view(torch.int16).numpy().view(np.uint16) if dtype is None else value.numpy()


def _exact_obs(obs: Any, specs: tuple, groups: dict) -> dict | None:
    """`_exact_value` of each observation field of ``obs`` (one array, or nested dicts of exactly
    the fields' names): the columns, name -> (array, dtype name); None when one is not exact."""
    if not has_keys(obs, groups):
        return None
    cols = {}
    for name, path, dtype, tdtype, shape, dtype_name in specs:
        array = _exact_value(at_path(obs, path), dtype, tdtype, shape)
        if array is None:
            return None
        cols[name] = (array, dtype_name)
    return cols


def done_flags(flags: Any, num_envs: int) -> Any:
    """One done flag per env from a step's flags of shape (N,) or (N, 1) (any nonzero is set)."""
    if type(flags) is np.ndarray and flags.dtype == bool and flags.ndim == 1:
        return flags
    return flags.reshape(num_envs, -1).any(axis=1)


def check_obs_chain(obs_cols: dict, previous: dict, envs: np.ndarray, steps: np.ndarray, env_ids: list[str],
                    schema: Schema) -> None:
    """Refuse a step of the mid-episode ``envs`` whose ``obs`` differs from their last ``next_obs``.

    Args:
        obs_cols: the step's observation columns, name -> (array, dtype name), [N, ...].
        previous: each observation field's last ``next_obs`` of ``envs`` (rows as stored or staged).
        envs: the envs whose episode goes on at this step (it has a step before).
        steps: the step each of ``envs`` is at in its episode.

    Raises:
        ObservationMismatchError: naming the first such env, its step and the fix; NaN
            equals NaN.
    """
    if not len(envs):
        return
    same = np.ones(len(envs), bool)
    for name, (column, dtype) in obs_cols.items():
        if name in previous:
            same &= same_rows(_as_stored(column[envs], dtype, schema.fields[name]), host_copy(previous[name]))
    if same.all():
        return
    k = int(np.flatnonzero(~same)[0])
    i, t = int(envs[k]), int(steps[k])
    raise ObservationMismatchError(
        f"env {env_ids[i]!r} (env {i}), step {t} of its episode: obs differs from the next_obs given at step {t - 1}. "
        "A writer stores each observation once (observation t + 1 is the next_obs of step t), so one of them would "
        "be replaced: the step is refused and nothing of it is recorded. Pass the next_obs a step returned as the "
        "next step's obs (normalise each observation once, as gymnasium's NormalizeObservation and TorchRL's "
        "VecNorm do, or store raw observations and normalise them when you sample); if the env was reset, end its "
        "episode first (terminated/truncated, or writer.flush())")


def passed_on(cols: dict, given: dict) -> bool:
    """A step's obs columns ``cols`` are the last step's next_obs columns ``given``, as the usual
    loop passes them on: the same memory (`same_memory`), else equal values (NaN equal to NaN).
    Cheap checks, before the exact one against the stored rows (`check_obs_chain`)."""
    if same_memory(cols, given):
        return True
    for name, (a, _) in cols.items():
        b = given[name][0] if name in given else None
        if b is None or type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype \
                or (is_tensor(a) and a.device != b.device) or not same_rows(a, b).all():
            return False
    return True


def same_memory(cols: dict, given: dict) -> bool:
    """Each column of ``cols`` is the one of ``given`` (a step's obs and the last step's next_obs),
    or lies in the same memory (address, shape, strides, dtype, device). It then holds what the
    writer stored from it (an env that rewrites one buffer in place included: the writer stored
    its values at that step)."""
    for name, (a, _) in cols.items():
        b = given[name][0] if name in given else None
        if a is b:
            continue
        if is_tensor(a) or is_tensor(b):
            if not (is_tensor(a) and is_tensor(b) and a.data_ptr() == b.data_ptr()
                    and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
                    and a.device == b.device):
                return False
        elif b is None or a.shape != b.shape or a.strides != b.strides or a.dtype != b.dtype \
                or a.__array_interface__["data"][0] != b.__array_interface__["data"][0]:
            return False
    return True


def _as_stored(values: Any, dtype: str, spec: Field) -> np.ndarray:
    """A step's observation rows as the store holds them: host numpy of the field's dtype
    (bfloat16 as its uint16 bits)."""
    if is_tensor(values):
        return host_copy(values.to(spec.torch_dtype))
    if dtype == spec.dtype:
        return values
    if spec.dtype == "bfloat16":
        import torch

        return host_copy(torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16))
    return values.astype(spec.numpy_dtype, copy=False)
