"""Mirrors of ``torchrec/distributed/sharding/``: one module per upstream file."""
