"""fastinit's ports of TorchRec's module construction code, one module per upstream file.

``fastinit/sharding/mirror/<path>.py`` mirrors ``torchrec/distributed/<path>.py``, so an upgrade's
upstream diff maps file to file (the planner's, ``torchrec/distributed/planner/<path>.py``, are
in :mod:`fastinit.planner`). Every mirrored function is registered, with the hash of the upstream
source per release, in ``fastinit/ports.py`` (docs/ports.md).
"""
