"""Seed compatibility: RLightning's ``DataBuffer`` API, config and types on arrowbuf.

``import arrowbuf.compat as compat``; ``compat.DataBuffer(cfg.buffer, cluster=cfg.cluster)``
takes the RLightning buffer config and cluster section and offers its methods.
Modules, one job each: `config` (the buffer config), `placement` (shards, train
workers, node affinity), `ingest` (EnvRets / PolicyResponses in), `staging` and
`segments` (records -> episodes, autoreset styles), `sink` (the store),
`reading` (indices and samplers), `data_buffer` and `buffers` (the facade),
`advantages` (`compute_gae`), `types` (also `arrowbuf.types`). What still
differs from the seed: docs/migrating-from-rlightning.md.
"""

from arrowbuf.compat.advantages import compute_gae
from arrowbuf.compat.config import BufferSettings, parse_config
from arrowbuf.compat.buffers import build_data_buffer
from arrowbuf.compat.data_buffer import BufferFullError, DataBuffer, ReplayBuffer, RolloutBuffer
from arrowbuf.compat.placement import ClusterKeyWarning
from arrowbuf.ray.shipping import resolve
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
    "ClusterKeyWarning",
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
    "resolve",
]
