"""Reading a writer's step: the arrays an env step returned, as columns checked against the schema.

`StepReader` turns one `arrowbuf.episodes.StepWriter.add` call's values (``obs``,
``next_obs``, the step fields, ``final_obs``) into columns of (array, dtype name),
inferring the schema before the first step and naming the field, the value and what
was expected when one does not match. Exact numpy steps take a fast path that skips
the checks' per-step cost; staging and sealing them is the writer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from arrowbuf.arena import owned_copy, step_tensor
from arrowbuf.errors import SchemaError
from arrowbuf.fields import as_array, check_column
from arrowbuf.schema import Schema, flatten
from arrowbuf.versions import as_version_schema, writer_fields


class StepReader:
    """Reads the steps of a writer of ``num_envs`` envs (staged on ``device``, in ``autoreset_mode``)."""

    def __init__(self, num_envs: int, device: torch.device | None, autoreset_mode: str) -> None:
        self.num_envs = num_envs
        self.device = device
        self.autoreset_mode = autoreset_mode
        self._exact: tuple[Schema, tuple | None] | None = None   # (schema, `_exact_specs` of it): the fast path's

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
        when ``obs`` and ``next_obs`` are numpy arrays and ``step`` holds exactly the other
        fields, each of its field's exact dtype and shape [num_envs, ...]; None for anything
        else (no schema yet, a Dict observation, a dtype that casts, a tensor, a bad
        value...), and `read` then reads it and names any error. What it accepts,
        `read`'s general path accepts unchanged: it only skips the checks' per-step cost (~25 us
        of a W2 step's ~50)."""
        if schema is None:
            return None
        if self._exact is None or self._exact[0] is not schema:
            self._exact = (schema, self._exact_specs(schema))
        specs = self._exact[1]
        if specs is None or len(step) + 1 != len(specs):
            return None
        (_, obs_dtype, obs_shape, obs_name), *step_specs = specs
        if type(obs) is not np.ndarray or obs.dtype != obs_dtype or obs.shape != obs_shape \
                or type(next_obs) is not np.ndarray or next_obs.dtype != obs_dtype or next_obs.shape != obs_shape:
            return None
        step_cols = {}
        for name, dtype, shape, dtype_name in step_specs:
            array = step.get(name)
            if type(array) is not np.ndarray or array.dtype != dtype or array.shape != shape:
                return None
            step_cols[name] = (array, dtype_name)
        return schema, {"obs": (obs, obs_name)}, {"obs": (next_obs, obs_name)}, step_cols

    def _exact_specs(self, schema: Schema) -> tuple[tuple[str, np.dtype, tuple[int, ...], str], ...] | None:
        """(name, numpy dtype, step shape [num_envs, ...], dtype name) of the observation
        ``obs``, then of each step field; None when the fast path cannot apply (staging on a
        device, observations other than one ``obs`` array, nested names, bfloat16)."""
        fields = writer_fields(schema)
        if self.device is not None or schema.observation_names != ("obs",) \
                or any("." in name or f.dtype == "bfloat16" for name, f in fields.items()):
            return None
        specs = [(name, f.numpy_dtype, (self.num_envs, *f.shape), f.dtype) for name, f in fields.items()]
        return tuple(sorted(specs, key=lambda spec: spec[0] != "obs"))

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
            ValueError: ``same_step`` mode and an episode ends without ``final_obs``.
            SchemaError: ``final_obs`` of other fields, dtypes or shapes than ``next_obs``.
        """
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
