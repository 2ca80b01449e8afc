"""Batches out of the shards' answers: one copy per request, then slices.

A request asks every shard for its share of several batches at once; batch j
takes ``kept[j, k]`` rows from answer k. `interleave` copies the answers into
one buffer per key, batch after batch, and `split_batches` slices it into
TensorDicts. A request answered by a single shard needs no copy: its batches
are views of Ray's read-only shared memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf._checks import tensor_to_numpy
from arrowbuf.tensors import make_tensordict


def interleave(parts: list[dict], kept: np.ndarray, starts: np.ndarray, total: int) -> dict:
    """One tensor per key holding every batch's rows: batch j gets ``kept[j, k]`` rows of part k
    (parts in order), its rows starting at ``starts[j]``; part k's rows come batch by batch."""
    within = np.cumsum(kept, axis=1) - kept        # where part k's rows start inside batch j
    combined = {key: torch.empty((total, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
                for key, tensor in parts[0].items()}
    for k, part in enumerate(parts):
        counts = kept[:, k]
        first_of_batch = np.cumsum(counts) - counts
        dest = np.repeat(starts + within[:, k] - first_of_batch, counts) + np.arange(int(counts.sum()))
        on_cpu = next(iter(part.values())).device.type == "cpu"
        dest_tensor = None if on_cpu else torch.from_numpy(dest).to(next(iter(part.values())).device)
        for key, tensor in part.items():
            if on_cpu:   # numpy's row scatter: 6x torch's index_copy_ for image rows
                tensor_to_numpy(combined[key])[dest] = tensor_to_numpy(tensor)
            else:
                combined[key].index_copy_(0, dest_tensor, tensor)
    return combined


def split_batches(sources: list[dict], kept: np.ndarray, tail: tuple, device: torch.device | None,
                  normalize_weights: bool) -> list[TensorDict]:
    """The batches of one request.

    Args:
        sources: each answering shard's tensors by key.
        kept: [batches, answers] rows each batch takes from each answer.
        tail: the item shape after the batch dim (sequence samplers: [L]).
        device: where the tensors are.
        normalize_weights: divide each batch's ``"weight"`` by its max (prioritized).
    """
    sizes = kept.sum(axis=1)
    starts = np.cumsum(sizes) - sizes
    combined = sources[0] if len(sources) == 1 else interleave(sources, kept, starts, int(sizes.sum()))
    on_device = device if device is not None and device.type != "cpu" else None
    batches = []
    for start, size in zip(starts.tolist(), sizes.tolist()):
        tensors: dict[Any, torch.Tensor] = {key: tensor[start:start + size] for key, tensor in combined.items()}
        if normalize_weights:
            tensors[("weight",)] = tensors[("weight",)] / tensors[("weight",)].max()
        batches.append(make_tensordict(tensors, (size, *tail), on_device))
    return batches
