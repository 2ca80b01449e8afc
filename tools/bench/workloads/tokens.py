"""TOKENS: ragged token fields (issue 34): memory, and a jagged batch against the ideal and TorchRL.

Rows are int32 token sequences of lognormal lengths (median 600, sigma 0.8: mean ~826;
`token_contenders`), one ``Field("int32", (None,))`` a store, written by ``add_episode`` in
episodes of ``episode_len`` steps (one array a step). Measured:

- private memory (USS growth, in a fresh process) of a store of ``memory_rows`` rows, filled a
  lap and a tenth (so the ring evicts and the heap frees chunks), over the token bytes it holds
  (sum of lengths x 4 = ``heap.live``). Target: <= 1.05 x the token bytes + 16 B a row. The
  growth is the whole store's (its few bytes a row of episode bookkeeping included).
- the sampled store's column bytes (heap chunks + 16 B a row of address and size) and
  ``heap.allocated / heap.live``, exact.
- ``store.sample(B)`` of ``rows`` rows (a jagged nested tensor) against the ideal gather
  (`IdealGather`: B uniform rows of one flat array copied into a preallocated buffer) and
  TorchRL's two storages that hold tensors of varying shapes, each batch made the jagged
  tensor a trainer needs (`TorchRLList`, `TorchRLStack`). Targets: arrowbuf/ideal >= 0.8,
  arrowbuf/torchrl >= 5 (issue 34's aim).
- ``store.sample(B, pad={"tokens": 0})`` (``[B, L_max]`` and ``tokens_length``) beside it,
  against the ideal's and TorchRL's padded batches; no target.
- every row of a jagged and a padded batch a round equals the row written (by episode id
  and step), and each contender's mean sampled length (the draws are uniform for all).

- ranks (``iter_batches(..., world_size=W, rank=r, balance="tokens")``'s step, for each rank in
  turn: `arrowbuf.groups.rank_share`, then ``store.gather`` of the share): the most tokens a
  rank gets over the mean, worst of 20 global batches of ``rank_rows`` rows a round (target
  <= 1.02), and whether the shares unite to each global batch exactly; the token bytes a
  second of split + gather of a ``global_tokens`` global batch over W ranks, all in this
  process, against the ideal's (one ``balanced_ranks`` split, each share copied as above: the
  ideal splits with arrowbuf's own balance, the fastest we have, so that it stays a floor of
  the same split rather than of a cheaper, worse one). Target >= 2 GB/s. A second row times a
  driver's split ("one split for all"): each global batch split once for all W ranks
  (`arrowbuf.groups.rank_shares`), then every share gathered (`ShardEngine.gather_each`):
  what ``iter_batches(..., world_size=W)`` without ``rank`` yields.

The store sizes are checked against the memory available first and scaled down (with a note)
where they would not fit.
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from ..harness import Options, Race, Workload, compare, flag_noisy, interleaved_times, load_note, log, over, \
    profile_calls, register, start_workload
from ..memory import heap_probe, private_bytes, reset_peak_rss, rss_bytes, run_probe
from ..results import Metric, Series, WorkloadResult
from ..token_contenders import MEDIAN, SIGMA, IdealGather, Tokens, TokenStore, TorchRLList, TorchRLStack, episode_rows

CONTENDERS = ["arrowbuf", "ideal", "torchrl", "torchrl_stack"]
LABELS = {"arrowbuf": "arrowbuf Field(int32, (None,))", "ideal": "ideal: np.concatenate into a preallocated buffer",
          "torchrl": "torchrl ListStorage + as_nested_tensor",
          "torchrl_stack": "torchrl LazyStackStorage + get(as_nested)"}
RATIO_COLUMNS = ["arrowbuf/ideal", "arrowbuf/torchrl", "arrowbuf/torchrl_stack"]
TARGETS = {"memory": 1.05, "row_bytes": 16, "sample": 0.8, "torchrl": 5.0, "balance": 1.02, "split_gbs": 2.0}
BALANCE_BATCHES = 20   # global batches a round whose rank balance is measured
MEAN_ROW_BYTES = 4 * MEDIAN * math.exp(SIGMA ** 2 / 2)   # int32 tokens of the lognormal's mean length
PAD = 0


@dataclass(frozen=True)
class TokensSpec:
    """The sizes of the stores each measurement fills."""

    rows: int               # rows of the sampled store (and of the ideal's flat array)
    memory_rows: int        # rows the memory probe's store holds
    peer_rows: int          # rows each of TorchRL's stores holds (a Python object or two a row)
    episode_len: int = 1000
    batch_size: int = 256
    world_size: int = 8
    rank_rows: int = 512          # rows of a global batch whose token balance is measured
    global_tokens: int = 1_000_000   # tokens (about) of the global batch split and gathered
    scaled: float = 1.0     # the fraction of the sizes above that fits the memory available

    def short(self) -> str:
        return (f"int32 tokens, lognormal lengths (median {MEDIAN}, sigma {SIGMA}); sample({self.batch_size}) of "
                f"{self.rows:,} rows; memory at {self.memory_rows:,} rows")

    def describe(self) -> str:
        return (f"tokens Field('int32', (None,)), lengths lognormal (median {MEDIAN}, sigma {SIGMA}, mean "
                f"~{MEAN_ROW_BYTES / 4:.0f}), episodes of {self.episode_len:,} steps; sampled store and ideal "
                f"{self.rows:,} rows, TorchRL's {self.peer_rows:,}; memory probe {self.memory_rows:,} rows")


def fitted(spec: TokensSpec, notes: list[str]) -> TokensSpec:
    """``spec``, its sizes scaled down where the memory available would not hold them (noted)."""
    objects = 2 * spec.peer_rows * 1500   # TorchRL's: ~1.5 kB of Python objects a row
    held = (2 * spec.rows + 2 * spec.peer_rows) * MEAN_ROW_BYTES + objects
    need = max(held, 1.2 * spec.memory_rows * MEAN_ROW_BYTES) + (2 << 30)   # + torch and friends
    available = available_bytes()
    if need <= 0.8 * available:
        return spec
    scale = 0.8 * available / need
    notes.append(f"  scaled down to {scale:.0%} of the spec's rows: it needs ~{need / 2**30:.1f} GiB, "
                 f"{available / 2**30:.1f} GiB available")
    return replace(spec, rows=int(spec.rows * scale), memory_rows=int(spec.memory_rows * scale),
                   peer_rows=int(spec.peer_rows * scale), scaled=scale)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (or the physical memory where it is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_tokens(spec: TokensSpec, opts: Options) -> WorkloadResult:
    """Probe memory first (a fresh process), then fill the stores and time their samples in rounds."""
    import arrowbuf  # noqa: F401  imported before start_workload freezes what exists
    import torchrl.data  # noqa: F401

    t0 = start_workload()
    load_start = os.getloadavg()[0]
    notes: list[str] = []
    spec = fitted(spec, notes)
    metrics = [memory_metric(spec, opts)] if opts.memory else []   # before the stores here take their memory
    metrics += sampled(spec, opts, notes)
    gc.collect()
    flag_noisy("TOKENS", metrics, notes)
    notes.append(load_note(load_start))
    return WorkloadResult("TOKENS", spec.short(), spec.describe(), CONTENDERS, metrics, notes,
                          time.perf_counter() - t0, labels=LABELS, ratio_columns=RATIO_COLUMNS)


def sampled(spec: TokensSpec, opts: Options, notes: list[str]) -> list[Metric]:
    """The sampled store, the ideal and TorchRL's: bytes, fidelity, and the interleaved sample times."""
    B = spec.batch_size
    start = time.perf_counter()
    tokens = Tokens(spec.rows)
    log(f"  TOKENS: {len(tokens):,} rows, {tokens.values.nbytes / 2**30:.2f} GiB of tokens drawn "
        f"({time.perf_counter() - start:.1f} s)")
    store = TokenStore(spec.rows)
    start = time.perf_counter()
    store.fill(tokens, spec.episode_len)
    seconds = time.perf_counter() - start
    notes.append(f"  add_episode: {len(tokens) / seconds:,.0f} rows/s, {tokens.values.nbytes / seconds / 1e9:.2f} GB/s "
                 f"of tokens ({spec.episode_len:,} arrays an episode)")
    column = store.column
    live, rows_held = int(column.heap.live), len(store.store)
    ideal = IdealGather(tokens, B)
    peers = {}
    for name, kind in (("torchrl", TorchRLList), ("torchrl_stack", TorchRLStack)):
        start = time.perf_counter()
        peers[name] = kind(tokens, min(spec.peer_rows, len(tokens)), B)
        log(f"  TOKENS: {name} filled ({len(peers[name]):,} rows, {time.perf_counter() - start:.1f} s)")

    jagged = {"arrowbuf": lambda: store.sample(B), "ideal": ideal.sample,
              **{name: peer.sample for name, peer in peers.items()}}
    pad = {"arrowbuf": lambda: store.sample(B, PAD), "ideal": lambda: ideal.padded(PAD),
           **{name: (lambda p=peer: p.padded(PAD)) for name, peer in peers.items()}}
    for fn in [*jagged.values(), *pad.values()]:   # warm-up: lazy imports, allocator pools
        for _ in range(3):
            fn()
    equal, mean_length = fidelity(store, tokens, jagged, opts.rounds)
    target = f"arrowbuf/ideal >= {TARGETS['sample']}, arrowbuf/torchrl >= {TARGETS['torchrl']:g}"
    metrics = compare("TOKENS", [
        Race(f"sample({B}), jagged", "ms", jagged, over("arrowbuf", "ideal", "torchrl", "torchrl_stack"),
             target=target, goal=lambda m: (m.ratios["arrowbuf/ideal"].median >= TARGETS["sample"]
                                            and m.ratios["arrowbuf/torchrl"].median >= TARGETS["torchrl"]),
             per_call=True, scale=1e3),
        Race(f"sample({B}, pad=)", "ms", pad, over("arrowbuf", "ideal", "torchrl", "torchrl_stack"),
             target="info: [B, L_max] + lengths", per_call=True, scale=1e3),
    ], opts.rounds, opts.min_time, opts.slices)
    nested, padded = metrics
    padded.ratios["arrowbuf padded time / jagged time"] = Series(
        [p / n for p, n in zip(padded.values["arrowbuf"].values, nested.values["arrowbuf"].values)])
    if opts.profile:
        notes.append(profile_calls(f"arrowbuf sample({B}) of ragged rows", jagged["arrowbuf"], 50))
        notes.append(profile_calls(f"arrowbuf sample({B}, pad=) of ragged rows", pad["arrowbuf"], 20))
    best = min(peers, key=lambda name: nested.values[name].median)
    notes.append(f"  TorchRL's faster storage for a jagged batch here: {LABELS[best]}; LazyTensorStorage cannot hold "
                 "a jagged field (its preallocated storage refuses the first write: index_put_ on a jagged tensor)")
    notes.append(f"  ideal: B uniform rows of one flat int32 array (its own offsets), offsets by cumsum, values by one "
                 f"np.concatenate of the rows' slices into a buffer preallocated for {B} of the longest rows and "
                 "reused (arrowbuf allocates each batch's), wrapped by nested_tensor_from_jagged; padded: fill "
                 "[B, L_max] of that buffer with the pad, then a slice copy a row. TorchRL pads by pad_sequence / "
                 "get(as_padded_tensor=True)")
    peer_rows = min(spec.peer_rows, len(tokens))
    notes.append(f"  TorchRL's stores hold the first {peer_rows:,} of the {len(tokens):,} rows (their own tensor a "
                 "row; a TensorDict a row in LazyStackStorage), to leave memory for the rest"
                 + (": both sizes are far beyond the caches, so a random row is a miss in each"
                    if peer_rows * MEAN_ROW_BYTES > 256 << 20 else ""))
    metrics = [nested, padded, *ranks(spec, opts, store, tokens, notes)]
    return metrics + [*byte_metrics(column, live, rows_held), *fidelity_metrics(equal, mean_length, B)]


def ranks(spec: TokensSpec, opts: Options, store: TokenStore, tokens: Tokens, notes: list[str]) -> list[Metric]:
    """Token balance over ranks, and split + gather of a global batch of ``global_tokens``."""
    from arrowbuf.groups import balanced_ranks, rank_share, rank_shares

    W, engine = spec.world_size, store.store.engine
    lo, hi = engine.live_range()   # one lap: transition index lo + i holds source row i

    def shares(indices: np.ndarray) -> list:
        """Each rank's share of a global batch, gathered, as ``iter_batches(world_size=W, rank=r)`` does."""
        return [store.store.gather(rank_share(engine, indices, W, r, "tokens", None)) for r in range(W)]

    rng = np.random.default_rng(3)
    balance, whole = Series(), Series()
    for _ in range(opts.rounds):
        worst, exact = 0.0, 0
        for _ in range(BALANCE_BATCHES):
            indices = rng.integers(lo, hi, spec.rank_rows)
            parts = shares(indices)
            load = np.array([int(p["tokens"].offsets()[-1]) for p in parts])
            worst = max(worst, float(load.max() / load.mean()))
            united = np.sort(np.concatenate([p["index"].numpy() for p in parts]))
            exact += np.array_equal(united, np.sort(indices))
        balance.values.append(worst)
        whole.values.append(100.0 * exact / BALANCE_BATCHES)

    rows = max(W, round(spec.global_tokens / float(tokens.lengths.mean())))
    batches = [rng.integers(lo, hi, rows) for _ in range(16)]
    delivered = float(np.mean([sum(int(p["tokens"].offsets()[-1]) for p in shares(b)) for b in batches])) * 4
    ideal = IdealGather(tokens, 2 * rows // W)
    turns = {name: itertools.count() for name in ("arrowbuf", "driver", "ideal")}

    def arrowbuf_split() -> None:
        shares(batches[next(turns["arrowbuf"]) % len(batches)])

    def driver_split() -> None:
        """One split for every rank, as ``iter_batches(world_size=W)`` without ``rank`` does (`rank_shares`,
        then `ShardEngine.gather_each`)."""
        engine.gather_each(rank_shares(engine, batches[next(turns["driver"]) % len(batches)], W, "tokens", None))

    def ideal_split() -> None:
        source = batches[next(turns["ideal"]) % len(batches)] - lo
        owner = balanced_ranks(tokens.lengths[source], W)
        for r in range(W):
            ideal.take(source[owner == r])

    for fn in (arrowbuf_split, driver_split, ideal_split):
        fn()
    name = f"split + gather, {spec.global_tokens / 1e6:g}M-token global batch over {W} ranks"
    target = f"arrowbuf >= {TARGETS['split_gbs']:g} GB/s"
    races = [Race(name, "GB/s", {"arrowbuf": arrowbuf_split, "ideal": ideal_split}, over("arrowbuf", "ideal"),
                  target=target + " (each rank its own split)", units=delivered / 1e9,
                  goal=lambda m: m.values["arrowbuf"].median >= TARGETS["split_gbs"]),
             Race(f"{name}, one split for all", "GB/s", {"arrowbuf": driver_split, "ideal": ideal_split},
                  over("arrowbuf", "ideal"), target=target + " (a driver's: iter_batches without rank)",
                  units=delivered / 1e9, goal=lambda m: m.values["arrowbuf"].median >= TARGETS["split_gbs"])]
    split, driver = compare("TOKENS", races, opts.rounds, opts.min_time, opts.slices)
    one = batches[0]
    timed = {"rank_share": lambda: rank_share(engine, one, W, 0, "tokens", None),
             "step": lambda: store.store.gather(rank_share(engine, one, W, 0, "tokens", None)),
             "balanced_ranks": lambda: balanced_ranks(tokens.lengths[one - lo], W)}
    ms = {k: 1e3 * t for k, t in interleaved_times(timed, opts.min_time, opts.slices).items()}
    notes.append(f"  ranks: rank 0's step on a {rows:,}-row global batch ({delivered / 4e6:.2f}M tokens), timed in "
                 f"turns: rank_share {ms['rank_share']:.2f} ms (balanced_ranks alone {ms['balanced_ranks']:.2f} ms), "
                 f"rank_share + gather of its share {ms['step']:.2f} ms; {W} ranks in {W} processes taking about "
                 f"that each would deliver {delivered / ms['step'] / 1e6:.2f} GB/s together. The first GB/s row runs "
                 f"all {W} ranks' steps in this process (each its own split, as each rank computes it: {W} "
                 "balances); the second ('one split for all') splits each global batch once for every rank, as "
                 "iter_batches(world_size=W) without rank gives a driver (rank_shares, then the engine's gather_each: "
                 "every share into its own tensors, the look-ups made once); the ideal splits once, with "
                 "arrowbuf's balanced_ranks")
    return [
        Metric(f"rank tokens max/mean, {spec.rank_rows} rows over {W} ranks", "x", {"arrowbuf": balance},
               target=f"arrowbuf <= {TARGETS['balance']} (worst of {BALANCE_BATCHES} global batches a round)",
               met=max(balance.values) <= TARGETS["balance"]),
        Metric("rank shares uniting to their global batch", "%", {"arrowbuf": whole},
               target="arrowbuf = 100 (each row once)", met=min(whole.values) == 100.0),
        split, driver,
    ]




def fidelity(store: TokenStore, tokens: Tokens, jagged: dict, rounds: int) -> tuple[Series, dict[str, float]]:
    """The share of rows of a jagged and a padded batch a round that equal the rows written (by
    episode id and step), and each contender's mean sampled row length over 20 batches."""
    equal = Series()
    for _ in range(rounds):
        same = total = 0
        batch = store.sample(256)
        values, offsets = batch["tokens"].values().numpy(), batch["tokens"].offsets().numpy()
        for i, row in enumerate(store.source_rows(batch).tolist()):
            same += np.array_equal(values[offsets[i]:offsets[i + 1]], tokens.row(row))
            total += 1
        batch = store.sample(256, PAD)
        dense, lengths = batch["tokens"].numpy(), batch["tokens_length"].numpy()
        for i, row in enumerate(store.source_rows(batch).tolist()):
            same += (lengths[i] == len(tokens.row(row)) and np.array_equal(dense[i, :lengths[i]], tokens.row(row))
                     and bool((dense[i, lengths[i]:] == PAD).all()))
            total += 1
        equal.values.append(100.0 * same / total)
    mean_length = {}
    for name, fn in jagged.items():
        lengths = []
        for _ in range(20):
            nested = fn()
            nested = nested["tokens"] if name == "arrowbuf" else nested
            lengths.append(np.diff(nested.offsets().numpy()))
        mean_length[name] = float(np.concatenate(lengths).mean())
    return equal, mean_length


def byte_metrics(column, live: int, rows: int) -> list[Metric]:
    """The sampled store's column bytes over its token bytes, and its heap's allocated over live."""
    return [
        Metric("column bytes / token bytes", "x", {"arrowbuf": column.nbytes / live},
               target=f"info: heap chunks + 16 B a row ({rows:,} rows, exact)"),
        Metric("heap allocated / live", "x", {"arrowbuf": column.heap.allocated / live},
               target="info: exact, of the sampled store (one lap)"),
    ]


def fidelity_metrics(equal: Series, mean_length: dict[str, float], batch_size: int) -> list[Metric]:
    """The share of sampled rows equal to those written, and the mean sampled length of each contender."""
    return [
        Metric("sampled rows equal to those written", "%", {"arrowbuf": equal},
               target="arrowbuf = 100 (a jagged and a padded batch of 256 a round)",
               met=min(equal.values) == 100.0),
        Metric("mean tokens a sampled row", "tokens", dict(mean_length),
               target=f"info: 20 batches of {batch_size} each; lognormal mean ~{MEAN_ROW_BYTES / 4:.0f}"),
    ]


def memory_metric(spec: TokensSpec, opts: Options) -> Metric:
    """The probe's private-memory growth over the token bytes it holds."""
    contender = "arrowbuf" if spec.scaled == 1.0 else f"arrowbuf@{spec.memory_rows}"
    probe = run_probe("TOKENS", contender, opts.quick, opts.smoke)
    rows, live, mib = probe["rows_held"], probe["heap_live"], 2**20
    bound = TARGETS["memory"] * live + TARGETS["row_bytes"] * rows
    text = (f"arrowbuf: {rows:,} rows held ({probe['episodes_added']:,} episodes added, a lap and a tenth), "
            f"{live / mib:,.0f} MiB of tokens ({live / rows:,.0f} B a row), heap chunks "
            f"{probe['heap_allocated'] / mib:,.0f} MiB, column {probe['column_nbytes'] / mib:,.0f} MiB; private "
            f"memory +{probe['private_delta'] / mib:,.0f} MiB (bound {bound / mib:,.0f} MiB), RSS "
            f"+{probe['rss_delta'] / mib:,.0f} MiB, peak RSS +{probe['peak_rss_delta'] / mib:,.0f} MiB; after "
            f"{probe['samples']} samples of {spec.batch_size}, private "
            f"+{probe['private_after_samples'] / mib:,.0f} MiB")
    if spec.memory_rows < 1_000_000:
        text += f" ({spec.memory_rows:,} rows: a quick, smoke or scaled-down run; the full run holds 1,000,000)"
    value = probe["private_delta"] / live
    limit = TARGETS["memory"] + TARGETS["row_bytes"] * rows / live
    return Metric("private memory / token bytes", "x", {"arrowbuf": value},
                  target=f"arrowbuf <= {limit:.3f}", met=probe["private_delta"] <= bound,
                  detail={"arrowbuf": probe, "text": text})


def probe_tokens(spec: TokensSpec, contender: str) -> dict:
    """Child process: private memory of a store of ``memory_rows`` rows (``contender``
    ``arrowbuf@N``: N rows, a scaled-down run's), filled a lap and a tenth."""
    import tensordict  # noqa: F401  every import before the baseline
    import torch

    import arrowbuf  # noqa: F401
    torch.set_num_threads(1)
    _, _, rows = contender.partition("@")
    capacity = int(rows) if rows else spec.memory_rows
    rng = np.random.default_rng(2)
    gc.collect()
    baseline, private = rss_bytes(), private_bytes()
    exact = reset_peak_rss()
    store = TokenStore(capacity)
    lap = -(-capacity // spec.episode_len)
    added = lap + max(1, lap // 10)
    for _ in range(added):
        store.add(episode_rows(rng, min(spec.episode_len, capacity)))
    return heap_probe(lambda: store.sample(spec.batch_size), store.column, baseline, private, exact,
                      contender=contender, rows_held=len(store.store), episodes_added=added)


register(Workload(
    "TOKENS", "ragged int32 tokens (lognormal lengths, mean ~826): memory at 1M rows, sample(256) jagged and "
              "padded vs an ideal gather and TorchRL",
    full=TokensSpec(rows=1_000_000, memory_rows=1_000_000, peer_rows=250_000),
    quick=TokensSpec(rows=50_000, memory_rows=50_000, peer_rows=20_000),
    smoke=TokensSpec(rows=3_000, memory_rows=10_000, peer_rows=1_000, episode_len=500, batch_size=32,
                     global_tokens=50_000),
    run=run_tokens, probe=probe_tokens))
