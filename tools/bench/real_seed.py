"""The real seed: RLightning's own ``DataBuffer``, types, configs and example hooks, from a checkout.

``python tools/seed_checkout.py`` clones RLightning's public repository into
``.rlightning/RLightning`` (git-ignored; its code is never committed) and puts
the few packages its buffer imports that arrowbuf's environment lacks into
``.rlightning/site``. The bench finds the checkout through ``--seed-repo``, the
``ARROWBUF_SEED_REPO`` environment variable, or that default place.

Importing ``rlightning`` runs its ``__init__``, which loads every engine, env
and policy (IsaacLab, ManiSkill, vLLM, ...). The buffer needs none of them: the
shim here registers module objects for ``rlightning`` and ``rlightning.env``
with ``__path__`` set, so their submodules import without running either
package's ``__init__``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / ".rlightning" / "RLightning"
ENV_VAR = "ARROWBUF_SEED_REPO"
#: Module objects made in place of these packages: their ``__init__`` loads engines and envs.
SHIMMED = ("rlightning", "rlightning.env")

_requested: str | None = None


def request(path: str | None) -> None:
    """``--seed-repo``: where the checkout is (wins over the environment variable)."""
    global _requested
    _requested = path


def locate() -> tuple[Path | None, str]:
    """(the checkout, '') or (None, why there is none)."""
    given = _requested or os.environ.get(ENV_VAR)
    path = Path(given).expanduser() if given else DEFAULT
    if (path / "rlightning" / "buffer" / "base_buffer.py").is_file():
        return path.resolve(), ""
    where = f"{'--seed-repo' if _requested else ENV_VAR} = {given}" if given else f"{path} (the default)"
    return None, (f"real seed absent: no RLightning checkout at {where}; run `python tools/seed_checkout.py` "
                  f"or pass --seed-repo / set {ENV_VAR}")


@dataclass
class Seed:
    """What the bench drives: RLightning's classes, configs and example hooks."""

    repo: Path
    RolloutBuffer: type
    ReplayBuffer: type
    BufferConfig: type
    EnvRet: type
    PolicyResponse: type
    BatchedData: type
    EnvMeta: type
    wbc_postprocess_fn: Callable
    vla_env_ret_preprocess_fn: Callable
    vla_policy_resp_preprocess_fn: Callable
    vla_postprocess_fn: Callable        # openvla's episode_postprocess_fn(policy_cfg, raw_episode)

    def config(self, relative: str) -> Any:
        """A shipped buffer config (``examples/.../conf/buffer/*.yaml``) as RLightning's ``BufferConfig``."""
        import yaml

        return self.BufferConfig(**yaml.safe_load((self.repo / relative).read_text()))


_loaded: dict[Path, Seed] = {}


def _example(repo: Path, relative: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, repo / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> tuple[Seed | None, str]:
    """(the seed, '') or (None, why it cannot be used): absent, or failing to import."""
    repo, why = locate()
    if repo is None:
        return None, why
    if repo in _loaded:
        return _loaded[repo], ""
    site = repo.parent / "site"
    if site.is_dir() and str(site) not in sys.path:
        sys.path.append(str(site))   # after the venv: its packages win
    for name in SHIMMED:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(repo / name.replace(".", "/"))]
            sys.modules[name] = module
    try:
        buffer = importlib.import_module("rlightning.buffer")
        rollout = importlib.import_module("rlightning.buffer.rollout_buffer")
        replay = importlib.import_module("rlightning.buffer.replay_buffer")
        rl_types = importlib.import_module("rlightning.types")
        wbc = _example(repo, "examples/wbc_tracking/utils.py", "_rlightning_wbc_utils")
        vla = _example(repo, "examples/openvla_ppo/utils.py", "_rlightning_openvla_utils")
    except Exception as err:  # noqa: BLE001  an unusable checkout is reported, not fatal
        return None, f"real seed at {repo} failed to import: {type(err).__name__}: {err}"
    seed = Seed(repo, rollout.RolloutBuffer, replay.ReplayBuffer, buffer.BufferConfig, rl_types.EnvRet,
                rl_types.PolicyResponse, rl_types.BatchedData, rl_types.EnvMeta, wbc.episode_postprocess_fn,
                vla.env_ret_preprocess_fn, vla.policy_resp_preprocess_fn, vla.episode_postprocess_fn)
    _loaded[repo] = seed
    return seed, ""
