"""On-policy rollout shapes (the seed's users, seed_spec section 4) and their synthetic data.

A rollout is ``envs`` vectorized envs x ``steps`` steps, collected time-major as
torch tensors (what a policy and an IsaacLab/ManiSkill env hand over):
observation fields ``[steps + 1, envs, ...]`` (the last one is the observation
after the last step), the others ``[steps, envs, ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .specs import FieldSpec, describe_fields


@dataclass(frozen=True)
class RolloutShape:
    """One rollout's shape; ``terminations`` is the chance that a step ends an env's episode."""

    name: str
    fields: Mapping[str, FieldSpec]
    envs: int
    steps: int
    terminations: float = 0.0

    @property
    def transitions(self) -> int:
        return self.envs * self.steps

    @property
    def row_bytes(self) -> int:
        return sum(f.row_bytes for f in self.fields.values())

    @property
    def observations(self) -> list[str]:
        return [n for n, f in self.fields.items() if f.observation]

    def short(self) -> str:
        return f"{self.name} {self.envs:,} envs x {self.steps} steps ({self.row_bytes:,} B/row)"

    def describe(self) -> str:
        return f"{self.name}: {self.envs:,} envs x {self.steps} steps; {describe_fields(self.fields)}"


FLAGS = {"terminated": FieldSpec("bool"), "truncated": FieldSpec("bool")}
WBC_FIELDS = {
    "obs": FieldSpec("float32", (160,), observation=True),
    "critic_obs": FieldSpec("float32", (286,), observation=True),
    "action": FieldSpec("float32", (29,)),
    "log_prob": FieldSpec("float32"),
    "value": FieldSpec("float32"),
    "reward": FieldSpec("float32"),
    **FLAGS,
}
VLA_FIELDS = {
    "pixel_values": FieldSpec("bfloat16", (6, 112, 112), observation=True),
    "action": FieldSpec("int64", (7,)),           # action tokens
    "log_prob": FieldSpec("float32", (7,)),
    "value": FieldSpec("float32"),
    "reward": FieldSpec("float32"),
    **FLAGS,
}


def wbc(envs: int, terminations: float = 0.0) -> RolloutShape:
    """Humanoid whole-body control (IsaacLab G1, RSL-RL PPO): 24-step rollouts."""
    return RolloutShape("WBC", WBC_FIELDS, envs, 24, terminations)


def vla(envs: int, steps: int) -> RolloutShape:
    """OpenVLA PPO (ManiSkill): bf16 pixel_values and action tokens."""
    return RolloutShape("VLA", VLA_FIELDS, envs, steps)


def make_rollout(shape: RolloutShape, seed: int = 0) -> dict[str, Any]:
    """The rollout, time-major torch tensors; ``terminated`` fires with chance ``shape.terminations``."""
    import torch
    rng = np.random.default_rng(seed)
    out = {}
    for name, f in shape.fields.items():
        dims = (shape.steps + 1 if f.observation else shape.steps, shape.envs, *f.shape)
        if f.dtype == "bool":
            flags = rng.random(dims) < shape.terminations if name == "terminated" else np.zeros(dims, bool)
            out[name] = torch.from_numpy(flags)
        elif f.dtype == "int64":
            out[name] = torch.from_numpy(rng.integers(0, 32_000, dims))
        else:
            values = torch.from_numpy(rng.standard_normal(dims, dtype=np.float32))
            out[name] = values.to(torch.bfloat16) if f.dtype == "bfloat16" else values
    return out


def transitions(shape: RolloutShape, rollout: Mapping[str, Any]) -> dict[str, Any]:
    """Every field at t, env-major ``[envs * steps, ...]`` (the seed's layout of a vector-env window)."""
    return {name: rollout[name][:shape.steps].transpose(0, 1).reshape(shape.transitions, *f.shape)
            for name, f in shape.fields.items()}


def ingest_native(store: Any, shape: RolloutShape, rollout: Mapping[str, Any], **writer_args: Any) -> None:
    """The rollout through ``store.writer``: one ``add`` per step, then ``flush``."""
    writer = store.writer(num_envs=shape.envs, **writer_args)
    obs = shape.observations
    steps = [name for name in shape.fields if name not in obs]
    same_step = writer_args.get("autoreset_mode") == "same_step"
    for t in range(shape.steps):
        after = {name: rollout[name][t + 1] for name in obs}
        writer.add(obs={name: rollout[name][t] for name in obs}, next_obs=after,
                   final_obs=after if same_step else None, **{name: rollout[name][t] for name in steps})
    writer.flush()


def episodes(shape: RolloutShape, rollout: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One episode per env (observation fields with their final row), for ``add_episode``."""
    return [{name: rollout[name][:, env] for name in shape.fields} for env in range(shape.envs)]
