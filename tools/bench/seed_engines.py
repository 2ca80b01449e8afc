"""SEED's rollouts as RLightning's engines run them, against the real seed (`real_seed`).

One *rollout* is what an engine does with its buffer each epoch, timed whole:

- WBC (``RSLRLEngine``, examples/wbc_tracking): per step ``add_batched_data_async``
  of the env returns, then of the (post-processed) policy responses; the final
  records, ``truncate_episodes``; ``sample(num_envs)`` (the shipped config:
  RolloutBuffer, unit episode, ``batch`` sampler, no auto-truncate) and the
  example's ``episode_postprocess_fn``; then the trainer's PPO minibatches.
- VLA (``SyncRLEngine``, examples/openvla_ppo): ``add_batched_transition`` per
  step (truncation on the last), with the example's env-return / response
  pre-processing and its ``episode_postprocess_fn`` (stack + PPO returns);
  ``sample(5120)`` (RolloutBuffer, ``all`` sampler); the trainer's minibatches.

Contenders: ``seed`` (RLightning's own ``RolloutBuffer``), ``compat``
(``arrowbuf.compat.DataBuffer``, same config, hooks and RLightning's own
``EnvRet`` / ``PolicyResponse`` / ``BatchedData``) and ``native`` (an
``ExperienceStore`` fed by ``store.writer``). The env returns and responses are
built once and handed to every contender, as local envs and policies hand over
their tensors. The trainer's minibatches (RSL-RL: 5 epochs x 4 minibatches;
OpenVLA: one epoch of minibatches of 160) are the same for all three: seed and
compat sample the rollout and the shared loop (`train`) indexes the batch, as the
engines' trainers do; native takes them from ``store.iter_batches(size,
epochs=..., drop_last=True)``, as the guide tells a PPO user of the native API to
(same sizes, same count, every row once per epoch, a new order each epoch). Native
through ``store.sample(n)`` and the shared loop measured 1.5-1.9x the seed on WBC
(2026-12-04): the loop's tensordict indexing then dominates.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from .rollouts import RolloutShape, ingest_native

ENV = "env-worker-0"
WBC_CONFIG = "examples/wbc_tracking/conf/buffer/rollout.yaml"
VLA_CONFIG = "examples/openvla_ppo/conf/buffer/rollout_buffer.yaml"
#: The shipped configs, for compat when the checkout is absent (the same values).
FALLBACK = {
    WBC_CONFIG: {"type": "RolloutBuffer", "capacity": 1_000_000, "auto_truncate_episode": False,
                 "storage": {"type": "unified", "unit": "episode", "device": "cpu"}, "sampler": {"type": "batch"}},
    VLA_CONFIG: {"type": "RolloutBuffer", "capacity": 10240, "storage": {"type": "unified", "device": "cpu"},
                 "sampler": {"type": "all"}},
}
#: openvla's policy config as its postprocess hook reads it (conf/policy/openvla_ppo.yaml).
VLA_POLICY_CFG = SimpleNamespace(ppo_cfg=SimpleNamespace(gamma=0.99, gae_lambda=0.95))
TRAINER = {"WBC": (5, 4), "VLA": (1, None)}   # (epochs, minibatches); VLA: minibatches of 160 rows
VLA_MINIBATCH = 160


def config_dict(config: Any) -> Any:
    """A pydantic BufferConfig as the plain dict compat reads (compat reads the model itself too)."""
    dump = getattr(config, "model_dump", None)
    return dump() if callable(dump) else config


def train(batch: Any, shape: RolloutShape) -> int:
    """The trainer's PPO minibatches over a sampled batch (shared by every contender); returns rows read."""
    import torch
    from tensordict import TensorDict, TensorDictBase

    if isinstance(batch, list):
        batch = batch[0]
    td = batch if isinstance(batch, TensorDictBase) else TensorDict.from_dict(batch, auto_batch_size=True)
    if td.batch_dims == 2:   # RSL-RL's update_dataset: [episodes, T] -> [T, episodes]
        td = td.permute(1, 0)
    flat = td.reshape(-1)
    n = flat.shape[0]
    epochs, minibatches = TRAINER[shape.name]
    size = n // minibatches if minibatches else VLA_MINIBATCH
    read = 0
    for _ in range(epochs):
        order = torch.randperm(n)
        for start in range(0, n - size + 1, size):
            read += flat[order[start:start + size]].batch_size[0]
    return read


class Inputs:
    """The rollout as env returns and policy responses of one type family (RLightning's, or arrowbuf.compat's)."""

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], types: Any) -> None:
        import torch

        self.shape = shape
        T = shape.steps
        zeros = {n: torch.zeros_like(rollout[n][0]) for n in ("reward", "terminated", "truncated")}
        self.env_rets, self.responses = [], []
        for t in range(T + 1):   # T steps and the final record
            last = {n: rollout[n][t - 1] if t else zeros[n] for n in zeros}
            s = min(t, T - 1)
            if shape.name == "WBC":   # the env's "policy" obs; RSL's post-processing adds the critic's and values
                observation = rollout["obs"][t]
                response = {"action": rollout["action"][s], "log_prob": rollout["log_prob"][s],
                            "value": rollout["value"][s], "critic_obs": rollout["critic_obs"][t]}
            else:                     # the camera image is not stored by the example; the policy's inputs are
                observation = {"image": torch.zeros(shape.envs, 8, dtype=torch.uint8)}
                response = {"actions": rollout["action"][s], "values": rollout["value"][s],
                            "logprobs": rollout["log_prob"][s], "bootstrap_values": zeros["reward"],
                            "forward_inputs": {"pixel_values": rollout["pixel_values"][t],
                                               "action_tokens": rollout["action"][s]}}
            self.env_rets.append(types.BatchedData([ENV], [types.EnvRet(
                ENV, observation, last_reward=last["reward"], last_terminated=last["terminated"],
                last_truncated=last["truncated"], info={})]))
            self.responses.append(types.BatchedData([ENV], [types.PolicyResponse(ENV, **response)]))


class EngineBuffer:
    """A seed-API buffer (RLightning's or arrowbuf.compat's) driven as the shape's engine drives it."""

    def __init__(self, make: Callable[[], Any], inputs: Inputs, meta: Any) -> None:
        self.make, self.inputs, self.meta = make, inputs, meta
        self.buffer = None

    def fresh(self) -> None:
        self.buffer = self.make()
        self.buffer.init([self.meta], [ENV])

    def ingest(self) -> None:
        buffer, inputs = self.buffer, self.inputs
        if inputs.shape.name == "WBC":   # RSLRLEngine.rollout
            for env_rets, responses in zip(inputs.env_rets, inputs.responses):
                buffer.add_batched_data_async(env_rets)
                buffer.add_batched_data_async(responses)
            buffer.truncate_episodes([ENV])
        else:                            # SyncRLEngine.rollout
            last = len(inputs.env_rets) - 1
            for t, (env_rets, responses) in enumerate(zip(inputs.env_rets, inputs.responses)):
                buffer.add_batched_transition(env_rets, responses, [t == last])

    def sample(self) -> Any:
        shape = self.inputs.shape
        return self.buffer.sample(batch_size=shape.envs if shape.name == "WBC" else shape.transitions)


#: What native samples: the fields the seed's batch carries for the trainer (its examples' hooks), no more.
#: WBC: both observations, the policy observation's next one (the hook's ``next_observation``), the step
#: fields. VLA: the policy's inputs and outputs, rewards, flags and the PPO returns (the openvla hook
#: computes returns and advantages; native computes them with ``compute_gae``); no next ``pixel_values``.
NATIVE_KEYS = {
    "WBC": [("obs",), ("next", "obs", "obs"), "action", "log_prob", "value", "reward", "terminated", "truncated"],
    "VLA": [("obs",), "action", "log_prob", "value", "reward", "terminated", "truncated", "advantage",
            "value_target"],
}


class NativeBuffer:
    """An ``ExperienceStore`` fed by ``store.writer`` (one ``add`` per step), its minibatches taken by
    ``iter_batches`` (`trains`), then cleared.

    The batches ask for `NATIVE_KEYS` (``keys=``), as a user feeding a PPO trainer does: without it they
    also carry every next observation (VLA: a second ``pixel_values``)."""

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any]) -> None:
        self.shape, self.rollout = shape, rollout
        self.store = None

    def fresh(self) -> None:
        import arrowbuf as ab

        self.store = ab.ExperienceStore(2 * self.shape.envs * (self.shape.steps + 1), seed=0)

    def ingest(self) -> None:
        mode = "same_step" if self.shape.name == "WBC" else "next_step"
        ingest_native(self.store, self.shape, self.rollout, autoreset_mode=mode)

    def trains(self) -> int:
        """The trainer's minibatches (as `train` makes them of a sampled batch) from ``iter_batches``;
        returns rows read."""
        if self.shape.name == "VLA":   # the openvla hook's PPO returns (gamma, lambda of its policy config)
            import torch

            ppo = VLA_POLICY_CFG.ppo_cfg   # the cut episodes bootstrap from 0, the responses' bootstrap_values
            self.store.compute_gae(ppo.gamma, ppo.gae_lambda, bootstrap_value=lambda final: torch.zeros(len(final)))
        epochs, minibatches = TRAINER[self.shape.name]
        n = len(self.store)
        size = n // minibatches if minibatches else VLA_MINIBATCH
        read = 0
        for batch in self.store.iter_batches(size, shuffle=True, drop_last=True, epochs=epochs,
                                             keys=NATIVE_KEYS[self.shape.name]):
            read += batch.batch_size[0]
        self.store.clear()
        return read


def contenders(shape: RolloutShape, rollout: Mapping[str, Any], seed: Any) -> dict[str, Any]:
    """seed (when loaded), compat and native for one shape."""
    import arrowbuf.compat as compat

    relative = WBC_CONFIG if shape.name == "WBC" else VLA_CONFIG
    config = seed.config(relative) if seed is not None else FALLBACK[relative]
    if shape.name == "WBC":
        hooks = lambda s: {"postprocess_fn": s.wbc_postprocess_fn}   # noqa: E731
    else:
        hooks = lambda s: {"env_ret_preprocess_fn": s.vla_env_ret_preprocess_fn,   # noqa: E731
                           "policy_resp_preprocess_fn": s.vla_policy_resp_preprocess_fn,
                           "postprocess_fn": lambda episode: s.vla_postprocess_fn(VLA_POLICY_CFG, episode)}
    out: dict[str, Any] = {}
    types = seed if seed is not None else compat
    inputs = Inputs(shape, rollout, types)
    if seed is not None:
        meta = seed.EnvMeta(ENV, None, None, num_envs=shape.envs)
        out["seed"] = EngineBuffer(lambda: seed.RolloutBuffer(config, **hooks(seed)), inputs, meta)
        compat_hooks = hooks(seed)
    else:
        meta = compat.EnvMeta(ENV, num_envs=shape.envs)
        compat_hooks = {}   # the example hooks live in the checkout; compat's defaults store the same fields
    out["compat"] = EngineBuffer(lambda: compat.DataBuffer(config_dict(config), seed=0, **compat_hooks), inputs,
                                 meta)
    out["native"] = NativeBuffer(shape, rollout)
    return out


def one_rollout(contender: Any, shape: RolloutShape, fresh: bool) -> tuple[float, float]:
    """(seconds of the whole rollout, seconds of its ingest); with ``fresh`` the buffer's construction counts."""
    start = time.perf_counter()
    if fresh:
        contender.fresh()
    begin = time.perf_counter()
    contender.ingest()
    ingested = time.perf_counter() - begin
    if isinstance(contender, NativeBuffer):
        contender.trains()
    else:
        train(contender.sample(), shape)
    return time.perf_counter() - start, ingested


def race_rollouts(shape: RolloutShape, seed: Any, why_absent: str, steady_rounds: int, fresh_rounds: int,
                  notes: list[str]) -> list:
    """Steady state (one buffer each, ``steady_rounds`` rollouts, the first left out) and fresh buffers
    (a new one per rollout), contenders interleaved in rotating order -> the metrics.

    Metrics: seconds per rollout with compat/seed and native/seed speed-ups (> 1: faster than the seed),
    and the ingest's max/min over the steady rollouts per contender."""
    import gc

    from .harness import log, rotated
    from .results import Metric, Series, speedup
    from .rollouts import make_rollout

    rollout = make_rollout(shape)
    racers = contenders(shape, rollout, seed)
    names = list(racers)
    metrics = []
    for mode, rounds in (("steady state", steady_rounds), ("fresh buffers", fresh_rounds)):
        fresh = mode == "fresh buffers"
        totals = {c: Series() for c in names}
        ingests = {c: Series() for c in names}
        for c in names:
            if not fresh:
                racers[c].fresh()
        for r in range(rounds):
            for c in rotated(names, r):
                total, ingest = one_rollout(racers[c], shape, fresh)
                if fresh or r > 0:   # steady state: the first rollout (first touch of every page) left out
                    totals[c].values.append(total)
                    ingests[c].values.append(ingest)
            gc.collect()
        log(f"  SEED {shape.name} {mode}: " + " ".join(f"{c}={totals[c].median:.3f}s" for c in names))
        ratios = {f"{c}/seed": speedup(totals[c], totals["seed"], higher_is_better=False)
                  for c in ("compat", "native") if "seed" in totals}
        values: dict[str, Any] = dict(totals)
        metric = Metric(f"{shape.name} rollout, {mode}", "s", values, ratios,
                        detail={"ingest_s": {c: s.values for c, s in ingests.items()}, "rounds": rounds,
                                "first_left_out": not fresh})
        metrics.append(metric)
        if not fresh:
            spread = {c: max(s.values) / min(s.values) for c, s in ingests.items() if s.values and min(s.values) > 0}
            metrics.append(Metric(f"{shape.name} ingest max/min, steady", "x", dict(spread), ratios_from_values=False,
                                  target="<= 2", met=all(v <= 2 for c, v in spread.items() if c != "seed")))
            notes.append(f"  {shape.name} steady ingest s (median [min-max]): " + "; ".join(
                f"{c} {s.median:.3f} [{min(s.values):.3f}-{max(s.values):.3f}]" for c, s in ingests.items()))
        for c in names:   # drop this mode's buffers before the next mode
            setattr(racers[c], "buffer" if hasattr(racers[c], "buffer") else "store", None)
        gc.collect()
    if seed is None:
        notes.append(f"  {shape.name}: {why_absent} (seed columns empty)")
    return metrics
