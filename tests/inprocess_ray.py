"""A stand-in for the `ray` module that runs roles in this process: the `in_process` fixture (tests/conftest.py).

Starting a role is starting a Python process that imports torch and transformers: seconds of CPU each, most of a
short run's cost. Tests of what the loop computes (the schema walk, the algorithms end to end, metrics, tracking,
resume, reward faults) run the real training loop (`relax.runner.train.run`) with this stand-in: the loop, the
roles and the backends stay real and only the transport is replaced: `ray.remote(cls).options(...).remote(...)`
builds the role object here, `handle.method.remote(...)` calls it, `ray.get` returns the value. Tests of what
processes do (placement, killed and hung roles, restarts, signals, weights through the object store, one run per
service graph) use a real Ray; tests/README.md lists which is which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from typing import Any


def _returned(value):
    """What the caller of a Ray actor's method gets: a copy, serialized into the object store before the actor runs
    its next call. Weight buffers alias the actor's live parameters until then (`WeightBuffers.of`), so here they
    are copied as Ray would: without it, a publish's weights would follow the trainer's next steps, and an engine
    loading them later would generate with newer weights than the version they carry."""
    from relax.models.weight_buffers import WeightBuffers

    if isinstance(value, WeightBuffers):
        return dataclasses.replace(value, arrays=tuple(a.copy() for a in value.arrays))
    return value


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return _returned(self._fn(*args, **kwargs))

    def options(self, **_: Any) -> _Method:
        return self


class _Handle:
    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class _RemoteClass:
    def __init__(self, cls):
        self._cls = cls

    def options(self, **_: Any) -> _RemoteClass:
        return self

    def remote(self, *args, **kwargs) -> _Handle:
        return _Handle(self._cls(*args, **kwargs))


def _get(value, timeout=None):
    return value


def _wait(values, num_returns=1, timeout=None, **_: Any):
    return list(values), []


class _Exceptions(types.SimpleNamespace):
    pass


class _ActorDied(Exception):
    """Never raised here (roles run in this process): errors of a role's method propagate as themselves."""


def fake_ray() -> types.ModuleType:
    ray = types.ModuleType("ray")
    ray.remote = lambda cls=None, **_: _RemoteClass(cls) if cls is not None else (lambda c: _RemoteClass(c))
    ray.get = _get
    ray.wait = _wait
    ray.put = lambda value: value
    ray.kill = lambda actor, **_: None
    ray.is_initialized = lambda: True
    ray.init = lambda *a, **k: None
    ray.shutdown = lambda: None
    ray.cluster_resources = lambda: {"CPU": float(os.cpu_count() or 1)}
    ray.available_resources = ray.cluster_resources
    ray.exceptions = _Exceptions(RayActorError=_ActorDied, GetTimeoutError=TimeoutError, RayTaskError=RuntimeError,
                                 ActorDiedError=_ActorDied)
    # nothing is pickled here: a pickler whose table of reductions (relax.roles.tensor_pickling's) nothing reads
    ray.cloudpickle = types.SimpleNamespace(CloudPickler=types.SimpleNamespace(dispatch={}))
    return ray


@contextlib.contextmanager
def inprocess_ray():
    """Replace `ray` in sys.modules while the block runs (the runner imports it inside its functions)."""
    saved = {k: v for k, v in sys.modules.items() if k == "ray" or k.startswith("ray.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["ray"] = fake_ray()
    try:
        yield
    finally:
        del sys.modules["ray"]
        sys.modules.update(saved)
