"""RLightning's rollout types for code written against its buffer (``ab.types``).

Defined in `arrowbuf.compat.types`; see `arrowbuf.compat` for the buffer that takes them.
"""

from arrowbuf.compat.types import (
    BatchedData,
    EnvMeta,
    EnvRet,
    MultiAgentEnvRet,
    MultiAgentPolicyResponse,
    PolicyResponse,
    Processed_EnvRet_fields,
)

__all__ = ["BatchedData", "EnvMeta", "EnvRet", "MultiAgentEnvRet", "MultiAgentPolicyResponse", "PolicyResponse",
           "Processed_EnvRet_fields"]
