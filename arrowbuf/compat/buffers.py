"""The seed's builder, `build_data_buffer`, over its registry names."""

from __future__ import annotations

from typing import Any

from arrowbuf.compat.data_buffer import BUFFERS, DataBuffer

__all__ = ["build_data_buffer"]


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
