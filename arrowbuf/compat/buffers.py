"""`ReplayBuffer` and `RolloutBuffer` (the seed's two buffer types) and the seed's builder."""

from __future__ import annotations

import logging
from typing import Any

from arrowbuf.compat.data_buffer import DataBuffer

logger = logging.getLogger(__name__)

__all__ = ["BUFFERS", "ReplayBuffer", "RolloutBuffer", "build_data_buffer"]


class ReplayBuffer(DataBuffer):
    """A DataBuffer for off-policy training: sampling keeps the data (config ``type`` may be omitted)."""

    buffer_type = "ReplayBuffer"


class RolloutBuffer(DataBuffer):
    """A DataBuffer for on-policy training: sampling clears what was stored."""

    buffer_type = "RolloutBuffer"

    def _check_batch(self, batch_size: int | None, total: int) -> None:
        if batch_size is None or self.settings.sampler == "all":
            return
        if batch_size > total:
            super()._check_batch(batch_size, total)
        if batch_size < total:
            logger.warning("batch_size %d is smaller than the %d stored %ss: a RolloutBuffer discards the rest "
                           "after sampling (pass batch_size=None or use sampler 'all' to use all data)",
                           batch_size, total, self.settings.unit)

    def _after_sample(self) -> None:
        self._sink.clear()


#: The config's ``type`` -> its class.
BUFFERS = {"ReplayBuffer": ReplayBuffer, "RolloutBuffer": RolloutBuffer}
#: The seed's registry names: its classes, and DataBuffer (the type comes from the config).
_REGISTRY = {**BUFFERS, "DataBuffer": DataBuffer}


def build_data_buffer(buffer_cls: Any, buffer_cfg: Any, *args: Any, **kwargs: Any) -> DataBuffer:
    """The seed's builder: ``buffer_cls`` is a class or a registered name
    ("ReplayBuffer", "RolloutBuffer", "DataBuffer"), e.g. ``config.buffer.type``.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(buffer_cls, str):
        if buffer_cls not in _REGISTRY:
            raise ValueError(f"buffer_cls: unknown buffer class {buffer_cls!r}; expected one of {sorted(_REGISTRY)}")
        buffer_cls = _REGISTRY[buffer_cls]
    return buffer_cls(buffer_cfg, *args, **kwargs)
