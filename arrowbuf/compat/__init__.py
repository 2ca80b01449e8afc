"""Seed compatibility: RLightning's ``DataBuffer`` API, config and types on arrowbuf.

``import arrowbuf.compat as compat``; ``compat.DataBuffer(cfg.buffer)`` takes the
RLightning buffer config and offers its methods (`arrowbuf.compat.data_buffer`
lists the semantics and what differs from the seed). The types are also
`arrowbuf.types`.
"""

from arrowbuf.compat.advantages import compute_gae
from arrowbuf.compat.config import BufferSettings, parse_config
from arrowbuf.compat.buffers import ReplayBuffer, RolloutBuffer, build_data_buffer
from arrowbuf.compat.data_buffer import BufferFullError, DataBuffer
from arrowbuf.compat.types import (
    BatchedData,
    EnvMeta,
    EnvRet,
    MultiAgentEnvRet,
    MultiAgentPolicyResponse,
    PolicyResponse,
    Processed_EnvRet_fields,
)

__all__ = [
    "BatchedData",
    "BufferFullError",
    "BufferSettings",
    "DataBuffer",
    "EnvMeta",
    "EnvRet",
    "MultiAgentEnvRet",
    "MultiAgentPolicyResponse",
    "PolicyResponse",
    "Processed_EnvRet_fields",
    "ReplayBuffer",
    "RolloutBuffer",
    "build_data_buffer",
    "compute_gae",
    "parse_config",
]
