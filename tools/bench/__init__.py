"""arrowbuf benchmarks: throughput and memory against an ideal baseline and peers.

Every performance claim is a *ratio measured in the same run*: the machine is
shared and noisy, so absolute numbers drift while paired ratios hold. In each
timing round the contenders take turns in short slices (rotating order), a ratio
is taken per round, and the median over rounds is reported with its min-max range.

Workloads (``--only W1,W2,W3,PER,RAY,PARQUET,ONPOLICY,GAE,SEED,MIX,IMAGES,TOKENS,VLA``; ``--list`` shows
them), one module each under ``workloads/`` with its protocol and targets in its
docstring:

- W1, W2 (`workloads.replay`): uniform replay of state rows (1M rows, batch 256)
  and pixel rows (100k rows of u8[84,84,3], batch 32): add, sample, peak RSS.
- W3 (`workloads.sequences`): 64 windows of 32 steps vs TorchRL's SliceSampler.
- PER (`workloads.prioritized`): proportional PER sample + update_priorities.
- RAY (`workloads.ray_store`): a 2-shard Ray store vs a naive replay actor.
- PARQUET (`workloads.persistence`): Parquet export/import vs pyarrow;
  incremental checkpoints vs full saves.
- ONPOLICY (`workloads.onpolicy`): PPO rollouts (WBC 4,096 x 24, VLA 32 x 160):
  whole-rollout sample and 4 x 8 minibatch epochs vs an ideal np.take, a
  seed-like TensorDict store and TorchRL.
- GAE (`workloads.gae`): ``compute_gae`` over the same rollouts vs per-step
  Python loops.
- SEED (`workloads.seed`): RLightning's engines through ``arrowbuf.compat``
  vs the native writer on the same data.
- MIX (`workloads.mixture`): a 25/75 mixture of a memory-mapped dataset and an
  online store vs the store alone; ``open_dataset`` of a 10M-row dataset;
  opt-in, ``--mix-dataset-gb N`` (`big_dataset`): an N GB dataset (larger than
  RAM if you like) sampled against a small one in RAM, with peak RSS.
- IMAGES (`workloads.images`): encoded image fields (u8[224,224,3] camera crops of
  a photo, `camera`): stored bytes of jpeg:90, png and zstd, jpeg:90's PSNR, private
  memory of 200k jpeg rows, and sample(256) against simplejpeg on 2 threads, the raw
  store and TorchRL's CompressedListStorage (`image_contenders`).
- TOKENS (`workloads.tokens`): ragged int32 token fields (lognormal lengths, mean ~826):
  private memory of 1M rows over their token bytes, sample(256), jagged and padded,
  against an ideal gather and TorchRL's ListStorage and LazyStackStorage (`token_contenders`),
  and global batches split over 8 ranks: token balance, split + gather GB/s.
- VLA (`workloads.vla`): an off-policy VLA's batches: LeRobot v3 demos whose camera is an
  AV1 video (`lerobot_video`: the layout, written by the bench with PyAV) mixed 50/50 with
  an online jpeg:90 store, Mixture.sample(256) rows/s beside a raw online store, and the
  video's sample(64) against PyAV decoding alone (`vla_contenders`).

Layout: `harness` (options, registry, interleaved timing, `harness.compare`: the
one path from rounds to ratios to metrics), `results`, `memory` (RSS and
per-contender probes in child processes), `report` (terminal tables, Markdown,
JSON), `summary` (the README's performance section, from a run's Markdown tables), `plot` (the bar chart), `specs` and `contenders` (replay data and
stores), `big_dataset` (MIX's big-dataset row), `rollouts` and `rollout_contenders` (on-policy data and stores), `camera` and
`image_contenders` (IMAGES' frames and stores), `token_contenders` (TOKENS' rows and stores), `lerobot_video`
and `vla_contenders` (VLA's demos, online stores and PyAV decoder), `cli`.

Adding a workload: a module under ``workloads/`` with a ``run(spec, opts) ->
WorkloadResult`` that times its contenders with `harness.compare`, registered
with `harness.register` (full and quick specs), and imported in
``workloads/__init__.py``; a ``probe(spec, contender) -> dict`` adds
per-contender memory probes.

Examples:
    python tools/bench.py                    # full run (all workloads)
    python tools/bench.py --quick            # smoke test, smaller sizes
    python tools/bench.py --only W1 --json out/bench.json
    python tools/bench.py --only W1 --profile   # cProfile arrowbuf's add and sample
    python tools/bench.py --markdown out/bench.json   # the Markdown tables of a saved run
    python tools/bench.py --markdown out/bench.json --docs   # ... written into docs/performance.md, and README.md's
                                                             # performance section from them
    python tools/bench.py --docs             # README.md's performance section from docs/performance.md's tables
    python tools/bench.py --plot out/bench.json       # tools/bench.png
    arrowbuf bench --quick --only ONPOLICY   # the same, from the installed CLI
    python tools/bench.py --only MIX --mix-dataset-gb 40   # + sampling a 40 GB dataset (built once)
"""
