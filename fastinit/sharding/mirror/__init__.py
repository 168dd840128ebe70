"""fastinit's ports of TorchRec code, one module per upstream file.

``fastinit/sharding/mirror/<path>.py`` mirrors ``torchrec/distributed/<path>.py``, so an upgrade's
upstream diff maps file to file. Every mirrored function is registered, with the hash of the
upstream source per release, in ``fastinit/ports.py`` (docs/ports.md).
"""
