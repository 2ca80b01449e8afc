"""A `Mixture` of sources with ragged (token) and text fields: one jagged tensor and one
NonTensorStack per batch, each row the one its source drew, shuffled or padded alike.

Every step's tokens are ``length`` copies of a code that names its source, episode and step
(and its ``obs`` carries the same code), so a row joined from the wrong source or offset shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arrowbuf as ab

T = 12


def code(source: int, episode: int, step: int) -> int:
    return 10_000 * source + 100 * episode + step


def length(c: int) -> int:
    return 1 + c % 7 + (c // 100) % 3   # 1..9 tokens, varying by step and episode


def filled(source: int, episodes: int = 4, text: bool = True) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=200, seed=source)
    for e in range(episodes):
        codes = [code(source, e, t) for t in range(T)]
        episode = {"obs": np.array([*codes, -1], np.float32)[:, None],
                   "action": np.zeros(T, np.int64), "terminated": np.arange(T) == T - 1,
                   "tokens": [np.full(length(c), c, np.int32) for c in codes]}
        if text:
            episode["instr"] = [f"source {source} episode {e}"] * T
        store.add_episode(episode)
    return store


def check_rows(batch, sources: dict[int, int] | None = None, padded: int | None = None) -> None:
    """Each row's tokens, text and obs are one step's, from the source ``batch["source"]`` names."""
    obs = batch["obs"][:, 0].numpy().astype(np.int64)
    source = batch["source"].numpy()
    assert len(obs) == batch.shape[0]
    if padded is None:
        offsets = batch["tokens"].offsets().numpy()
        values = batch["tokens"].values().numpy()
        rows = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    else:
        dense, lengths = batch["tokens"].numpy(), batch["tokens_length"].numpy()
        assert dense.shape == (len(obs), int(lengths.max()))   # padded to the batch's longest row
        rows = [dense[i, :n] for i, n in enumerate(lengths)]
        for i, n in enumerate(lengths):
            assert (dense[i, n:] == padded).all()
    for i, c in enumerate(obs):
        assert c // 10_000 == (sources or {}).get(int(source[i]), int(source[i])), (i, c, source[i])
        np.testing.assert_array_equal(rows[i], np.full(length(c), c, np.int32))
        if "instr" in batch.keys():
            assert batch["instr"][i] == f"source {c // 10_000} episode {(c // 100) % 100}"


def test_a_mixture_joins_ragged_and_text_fields_of_its_sources_row_by_row():
    mixture = ab.Mixture({"demos": filled(0), "online": filled(1)}, weights={"demos": 0.25, "online": 0.75}, seed=0)
    for size in (1, 8, 37):
        batch = mixture.sample(size)
        assert batch["tokens"].is_nested and batch["tokens"].layout == torch.jagged
        assert batch["source"].tolist() == sorted(batch["source"].tolist())   # grouped by source
        check_rows(batch)
        assert len(batch["instr"]) == size


def test_a_shuffled_mixture_moves_ragged_and_text_rows_with_their_steps():
    mixture = ab.Mixture({"demos": filled(0), "online": filled(1)}, weights={"demos": 0.5, "online": 0.5},
                         shuffle=True, seed=3)
    batch = mixture.sample(64)
    assert batch["source"].tolist() != sorted(batch["source"].tolist())   # 64 rows: not left in order
    check_rows(batch)


def test_pad_pads_every_source_to_the_longest_row_of_the_whole_batch():
    mixture = ab.Mixture({"demos": filled(0), "online": filled(1)}, weights={"demos": 0.5, "online": 0.5}, seed=1)
    for _ in range(5):   # the sources' own longest rows differ in some of these batches
        check_rows(mixture.sample(6, pad={"tokens": -7}), padded=-7)


def test_sample_iter_pads_as_sample_does_over_stores_and_datasets(tmp_path):
    """``pad=`` reached each source's sample_iter, which took no such argument (TypeError)."""
    dataset = ab.open_dataset(filled(0, text=False).to_parquet(tmp_path / "demos", progress=False), seed=0,
                              progress=False)
    mixture = ab.Mixture({"demos": dataset, "online": filled(1, text=False)}, weights={"demos": 0.5, "online": 0.5},
                         seed=1)
    stream = mixture.sample_iter(6, pad={"tokens": -7})
    for _ in range(5):
        check_rows(next(stream), padded=-7)
    alone = next(filled(2).sample_iter(5, pad={"tokens": -1}))
    alone["source"] = torch.full((5,), 2)
    check_rows(alone, padded=-1)
    with pytest.raises(ValueError, match="pad"):
        dataset.sample_iter(4, pad={"obs": 0})   # not a ragged field: refused when called


def test_keys_leave_ragged_and_text_fields_out_and_sample_iter_joins_them_too():
    mixture = ab.Mixture({"demos": filled(0), "online": filled(1)}, weights={"demos": 0.5, "online": 0.5}, seed=2)
    plain = mixture.sample(8, keys=["obs", "action"])
    assert "tokens" not in plain.keys() and "instr" not in plain.keys()
    stream = mixture.sample_iter(9)
    for _ in range(3):
        check_rows(next(stream))


def test_a_dataset_with_a_ragged_field_mixes_with_an_online_store(tmp_path):
    export = filled(0, text=False).to_parquet(tmp_path / "demos", progress=False)
    dataset = ab.open_dataset(export, seed=0, progress=False)
    mixture = ab.Mixture({"demos": dataset, "online": filled(1, text=False)}, weights={"demos": 0.5, "online": 0.5},
                         shuffle=True, seed=0)
    check_rows(mixture.sample(32))


def test_sources_whose_ragged_fields_differ_are_refused_naming_the_keys():
    mixture = ab.Mixture({"demos": filled(0, text=False), "online": filled(1)}, weights={"demos": 0.5, "online": 0.5})
    with pytest.raises(ValueError, match=r"different keys.*instr"):
        mixture.sample(8)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_joined_jagged_tensor_records_its_longest_row_as_a_store_s_batch_does(shuffle):
    # to_padded_tensor (and attention kernels) read the recorded longest row, not the values
    mixture = ab.Mixture({"demos": filled(0), "online": filled(1)}, weights={"demos": 0.5, "online": 0.5},
                         shuffle=shuffle, seed=4)
    for _ in range(5):
        tokens = mixture.sample(12)["tokens"]
        lengths = tokens.offsets().diff()
        padded = tokens.to_padded_tensor(-1)
        assert padded.shape == (12, int(lengths.max())), (padded.shape, lengths.tolist())
        for i, n in enumerate(lengths.tolist()):
            assert torch.equal(padded[i, :n], tokens.values()[int(tokens.offsets()[i]):int(tokens.offsets()[i + 1])])
