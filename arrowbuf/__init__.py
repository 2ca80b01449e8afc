"""arrowbuf: a columnar experience store for reinforcement learning.

Episodes are stored as Arrow-compatible columns in a ring arena, sampled by index,
and returned as TensorDicts whose tensors are views of one gathered buffer.
"""

from arrowbuf.episodes import StepWriter
from arrowbuf.errors import ArrowbufError, CapacityError, EmptyStoreError, SchemaError, ShardError
from arrowbuf.samplers import UniformSampler
from arrowbuf.schema import Field, Schema
from arrowbuf.store import ExperienceStore

__version__ = "0.1.0"

__all__ = [
    "ArrowbufError",
    "CapacityError",
    "EmptyStoreError",
    "ExperienceStore",
    "Field",
    "Schema",
    "SchemaError",
    "ShardError",
    "StepWriter",
    "UniformSampler",
    "__version__",
]
