"""Mirrors of ``torchrec/distributed/planner/estimator/`` (see ``fastinit.sharding.mirror``)."""
