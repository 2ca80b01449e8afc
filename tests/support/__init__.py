"""What the tests share besides fixtures: tagged episodes, the ring model, fake envs, comparisons.

Test modules import these as ``support.<module>`` (pytest puts ``tests/`` on
``sys.path``); ``conftest.py`` holds only fixtures and hooks.

| module | owns |
|---|---|
| `episodes.py` | the tagged-episode encoding, its decoder, and the check of a sample against it |
| `ring.py` | the reference model of the ring and the exhaustive check of a store against it |
| `compare.py` | columns as numpy, snapshots, and equality of stores, rows and batches |
| `envs.py` | a scripted vector env for the step writer, and real CartPole stores |
| `compat_envs.py` | fake RLightning env workers, policies and engine call sequences |
| `persist_data.py` | the stores the export and checkpoint tests round-trip, and a checkpoint editor |
| `actors.py` | waiting for a killed Ray actor to be gone |
| `ray_stores.py` | Ray stores a test module shares, one per configuration, emptied for each test |
| `hops.py` | module hops: the calls of a code path from one arrowbuf module into another (`sys.setprofile`) |
"""
