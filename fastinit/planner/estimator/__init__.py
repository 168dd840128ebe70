"""Mirrors of ``torchrec/distributed/planner/estimator/`` (see :mod:`fastinit.planner`)."""
