"""arrowbuf: a columnar experience store for reinforcement learning.

Episodes are stored as Arrow-compatible columns in a ring arena, sampled by index,
and returned as TensorDicts whose tensors are views of one gathered buffer.
"""

from typing import TYPE_CHECKING

from arrowbuf._version import __version__

# The names below load on first use (module __getattr__): `import arrowbuf` alone imports
# no torch or tensordict, so a process that needs one module of the package (a Ray shard
# actor, `arrowbuf --help`) pays only for the modules that one imports.
_LAZY = {
    "arrowbuf.autoreset": ["AutoresetModeError"],
    "arrowbuf.dataset": ["Dataset", "open_dataset"],
    "arrowbuf.episodes": ["StepWriter"],
    "arrowbuf.errors": ["ArrowbufError", "CapacityError", "EmptyStoreError", "FormatError", "InUseError",
                        "ObservationMismatchError", "RateLimited", "ResourceError", "SchemaError", "ShardError",
                        "WriterClosedError"],
    "arrowbuf.fields": ["Field"],
    "arrowbuf.freshness": ["FreshnessSampler"],
    "arrowbuf.groups": ["GroupSampler"],
    "arrowbuf.mixture": ["Mixture"],
    "arrowbuf.parquet": ["read_parquet"],
    "arrowbuf.rate_limiters": ["MinSize", "RateLimiter", "SampleToInsertRatio"],
    "arrowbuf.ray.options": ["RayOptions"],
    "arrowbuf.samplers": ["EpisodeSampler", "PrioritizedSampler", "Sampler", "SequenceSampler", "UniformSampler",
                          "WithoutReplacementSampler"],
    "arrowbuf.schema": ["Schema"],
    "arrowbuf.store": ["ExperienceStore"],
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:
    from arrowbuf.autoreset import AutoresetModeError
    from arrowbuf.dataset import Dataset, open_dataset
    from arrowbuf.episodes import StepWriter
    from arrowbuf.errors import (ArrowbufError, CapacityError, EmptyStoreError, FormatError, InUseError,
                                 ObservationMismatchError, RateLimited, ResourceError, SchemaError, ShardError,
                                 WriterClosedError)
    from arrowbuf.fields import Field
    from arrowbuf.freshness import FreshnessSampler
    from arrowbuf.groups import GroupSampler
    from arrowbuf.mixture import Mixture
    from arrowbuf.parquet import read_parquet
    from arrowbuf.rate_limiters import MinSize, RateLimiter, SampleToInsertRatio
    from arrowbuf.ray.options import RayOptions
    from arrowbuf.samplers import (EpisodeSampler, PrioritizedSampler, Sampler, SequenceSampler, UniformSampler,
                                   WithoutReplacementSampler)
    from arrowbuf.schema import Schema
    from arrowbuf.store import ExperienceStore

__all__ = [
    "ArrowbufError",
    "AutoresetModeError",
    "CapacityError",
    "Dataset",
    "EmptyStoreError",
    "ExperienceStore",
    "EpisodeSampler",
    "FreshnessSampler",
    "Field",
    "FormatError",
    "GroupSampler",
    "InUseError",
    "MinSize",
    "Mixture",
    "ObservationMismatchError",
    "PrioritizedSampler",
    "RateLimited",
    "RateLimiter",
    "RayOptions",
    "ResourceError",
    "SampleToInsertRatio",
    "Sampler",
    "SequenceSampler",
    "Schema",
    "SchemaError",
    "ShardError",
    "StepWriter",
    "UniformSampler",
    "WithoutReplacementSampler",
    "WriterClosedError",
    "open_dataset",
    "read_parquet",
    "__version__",
]


def __getattr__(name: str):
    import importlib
    import os

    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value   # the next lookup finds it without this function
        return value
    # `arrowbuf.schema` after a bare `import arrowbuf`, as when every module loaded with it
    here = os.path.dirname(__file__)
    if name.isidentifier() and not name.startswith("__") and (
            os.path.isfile(os.path.join(here, name + ".py")) or os.path.isdir(os.path.join(here, name))):
        return importlib.import_module(f"arrowbuf.{name}")
    raise AttributeError(f"module 'arrowbuf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
