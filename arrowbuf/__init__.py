"""arrowbuf: a columnar experience store for reinforcement learning.

Episodes are stored as Arrow-compatible columns in a ring arena, sampled by index,
and returned as TensorDicts whose tensors are views of one gathered buffer.
"""

from arrowbuf.autoreset import AutoresetModeError
from arrowbuf.dataset import Dataset, open_dataset
from arrowbuf.episodes import StepWriter
from arrowbuf.errors import (ArrowbufError, CapacityError, EmptyStoreError, FormatError, InUseError,
                             ObservationMismatchError, RateLimited, ResourceError, SchemaError, ShardError,
                             WriterClosedError)
from arrowbuf.fields import Field
from arrowbuf.freshness import FreshnessSampler
from arrowbuf.mixture import Mixture
from arrowbuf.parquet import read_parquet
from arrowbuf.rate_limiters import MinSize, RateLimiter, SampleToInsertRatio
from arrowbuf.ray.options import RayOptions
from arrowbuf.samplers import (EpisodeSampler, PrioritizedSampler, Sampler, SequenceSampler, UniformSampler,
                               WithoutReplacementSampler)
from arrowbuf.schema import Schema
from arrowbuf._version import __version__
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
