"""One module per workload; importing this package registers them all, in run order."""

# isort: off   (the import order is the run order)
from . import replay, sequences, prioritized, ray_store, persistence, onpolicy, gae, seed, mixture, images, tokens, vla  # noqa: F401
