"""Mirrors of ``torchrec/distributed/planner/`` (see ``fastinit.sharding.mirror``)."""
