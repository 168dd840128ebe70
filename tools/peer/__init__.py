"""TorchRec's own model-parallel tests, run with ``DistributedModelParallel(...)`` swapped for
``fastinit.setup(...)``: see :mod:`tools.peer.run` (``make peer``)."""
