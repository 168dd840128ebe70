"""Compiled artifacts kept across jobs, so a restart does not pay the cold compile again.

An entry is keyed by the torch version, the device (and, on CUDA, its capability), the Python
version and a fingerprint of the compiled modules (their structure, parameter shapes and dtypes,
and the compile settings). It holds two forms of the same artifacts:

* ``artifacts.bin`` — :func:`torch.compiler.save_cache_artifacts` ("MegaCache"): one portable file
  that can be shipped to other hosts; :func:`torch.compiler.load_cache_artifacts` unpacks it into
  the local Inductor caches before compiling;
* ``inductor/`` — used as ``TORCHINDUCTOR_CACHE_DIR`` while the entry is active, so the FX-graph,
  AOTAutograd and C++/Triton caches written by the first job are read directly by the next.

On CPU the second form is what actually helps. Measured for the reference dense arch + over arch,
forward + backward, fresh process each (``python -m benchmarks.bench_warmup``, 2 shared cores):
cold compile 18.8 s, MegaCache loaded into an empty Inductor directory 22.0 s (no gain: dynamo and
AOTAutograd still run, and the C++ is rebuilt), warm Inductor directory 4.4 s. (Earlier, on a
quieter machine: 10-15 s, 9.1 s, 1.3 s.) When the Inductor directory is warm the
MegaCache file is not loaded at all; it is loaded when the directory is missing (a new host).

Files are written atomically (temporary file + ``os.replace``); ``meta.json`` is written last and
holds the artifacts' SHA-256, so a torn or corrupt entry is detected, ignored with a warning and
replaced by the next save. Concurrent writers with the same key write identical content.

Example::

    cache = CompileCache(fingerprint=module_fingerprint([model.over_arch]))
    with cache:  # restore(); TORCHINDUCTOR_CACHE_DIR points into the entry until exit
        warm_up(model, batch, config=...)
        cache.save()
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from fastinit import knobs

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "CompileCacheConfig",
    "CacheRestore",
    "CompileCache",
    "module_fingerprint",
]

_FORMAT = 1
_ARTIFACTS = "artifacts.bin"
_META = "meta.json"
_INDUCTOR = "inductor"
_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclasses.dataclass(kw_only=True, slots=True)
class CompileCacheConfig:
    """Where and how compiled artifacts are kept."""

    directory: str | None = None
    """Root of the cache; None: ``FASTINIT_COMPILE_CACHE``; neither: the cache is off."""
    mega_cache: bool = True
    """Save/load the portable ``torch.compiler`` artifacts file."""
    inductor_dir: bool = True
    """Point ``TORCHINDUCTOR_CACHE_DIR`` into the entry while it is active."""
    device: str = "cpu"
    """Device type the code is compiled for (part of the key)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class CacheRestore:
    """What :meth:`CompileCache.restore` found."""

    status: str
    """"hit" (something warm was found), "miss", "corrupt" (ignored with a warning) or "off"."""
    artifacts_loaded: bool = False
    """The MegaCache file was loaded into the Inductor caches."""
    inductor_warm: bool = False
    """The entry's Inductor directory already held compiled code."""
    seconds: float = 0.0
    """Time spent restoring."""


def module_fingerprint(
    modules: nn.Module | Iterable[nn.Module], extra: Mapping[str, Any] | None = None
) -> str:
    """A stable digest of what compiled code depends on: each module's class and printed structure
    (which shows layer hyperparameters), and each parameter's and buffer's name, shape, dtype and
    ``requires_grad`` — not their values. ``extra`` adds settings (backend, mode, dynamic dims)."""
    from torch import nn

    items = [modules] if isinstance(modules, nn.Module) else list(modules)
    parts: list[Any] = []
    for module in items:
        tensors = [
            (name, list(t.shape), str(t.dtype), bool(t.requires_grad))
            for name, t in [*module.named_parameters(), *module.named_buffers()]
        ]
        parts.append(
            {
                "class": f"{type(module).__module__}.{type(module).__qualname__}",
                "repr": repr(module),
                "tensors": tensors,
            }
        )
    parts.append(dict(sorted((extra or {}).items())))
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CompileCache:
    """One cache entry for one compiled model; see the module docstring.

    Args:
        fingerprint: :func:`module_fingerprint` of what is compiled.
        config: directory and forms (default :class:`CompileCacheConfig`).
    """

    def __init__(self, fingerprint: str, config: CompileCacheConfig | None = None) -> None:
        self.config = config or CompileCacheConfig()
        root = self.config.directory or knobs.get_compile_cache()
        self.key_fields = self._key_fields(fingerprint)
        self.key = hashlib.sha256(json.dumps(self.key_fields, sort_keys=True).encode()).hexdigest()
        self.path: str | None = os.path.join(root, self.key[:32]) if root else None
        self._saved_env: str | None = None
        self._env_set = False

    def _key_fields(self, fingerprint: str) -> dict[str, Any]:
        import torch

        device = self.config.device
        if device.startswith("cuda") and torch.cuda.is_available():
            device = f"cuda-sm{''.join(map(str, torch.cuda.get_device_capability()))}"
        return {
            "format": _FORMAT,
            "torch": torch.__version__,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "device": device,
            "fingerprint": fingerprint,
        }

    @property
    def enabled(self) -> bool:
        """A cache directory is configured."""
        return self.path is not None

    @property
    def inductor_path(self) -> str | None:
        """The entry's Inductor cache directory (None when off)."""
        if self.path is None or not self.config.inductor_dir:
            return None
        return os.path.join(self.path, _INDUCTOR)

    # -- restore -------------------------------------------------------------------------------

    def restore(self) -> CacheRestore:
        """Activate the entry before compiling: point Inductor at its directory and, if that is
        not warm, load the MegaCache file. Never raises on a bad entry (warns instead)."""
        start = time.perf_counter()
        if self.path is None:
            return CacheRestore(status="off")
        warm = False
        inductor = self.inductor_path
        if inductor is not None:
            warm = os.path.isdir(inductor) and any(os.scandir(inductor))
            os.makedirs(inductor, exist_ok=True)
            if not self._env_set:
                self._saved_env = os.environ.get(_ENV)
                self._env_set = True
            os.environ[_ENV] = inductor
        loaded = False
        corrupt = False
        if self.config.mega_cache and not warm:
            data = self._read_artifacts()
            if isinstance(data, bytes):
                loaded = self._load(data)
                corrupt = not loaded
            elif data is False:
                corrupt = True
        status = "corrupt" if corrupt else ("hit" if warm or loaded else "miss")
        return CacheRestore(
            status=status,
            artifacts_loaded=loaded,
            inductor_warm=warm,
            seconds=time.perf_counter() - start,
        )

    def _read_artifacts(self) -> bytes | Literal[False] | None:
        """The verified artifacts; None if absent; False if corrupt (and the entry discarded)."""
        assert self.path is not None
        meta_path = os.path.join(self.path, _META)
        data_path = os.path.join(self.path, _ARTIFACTS)
        if not os.path.exists(meta_path):
            return None
        try:
            with open(meta_path, "rb") as f:
                meta = json.loads(f.read())
            if meta.get("key") != self.key_fields:
                raise ValueError("key fields differ from this job's")
            with open(data_path, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                raise ValueError("artifacts checksum mismatch")
        except (OSError, ValueError, TypeError, AttributeError) as e:
            self._discard(f"{type(e).__name__}: {e}")
            return False
        return data

    def _load(self, data: bytes) -> bool:
        import torch

        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as e:  # noqa: BLE001 - any failure means: compile from scratch
            self._discard(f"load_cache_artifacts failed: {type(e).__name__}: {e}")
            return False
        if info is None:  # torch logs why and returns None when it cannot unpack the bytes
            self._discard("load_cache_artifacts failed: torch could not unpack the artifacts")
            return False
        return True

    def _discard(self, why: str) -> None:
        assert self.path is not None
        warnings.warn(
            f"fastinit: ignoring corrupt compile-cache entry {self.path} ({why}); "
            "compiling from scratch",
            RuntimeWarning,
            stacklevel=3,
        )
        for name in (_META, _ARTIFACTS):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, name))

    # -- save ----------------------------------------------------------------------------------

    def save(self) -> bool:
        """Persist the artifacts compiled so far in this process (after the first compiled step).

        The Inductor directory fills itself while compiling; this writes the MegaCache file and
        its metadata, atomically. Returns False when the cache is off or there is nothing to save.
        """
        if self.path is None or not self.config.mega_cache:
            return False
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        data, _info = saved
        if not data:
            return False
        meta = {
            "key": self.key_fields,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "created": time.time(),
        }
        _atomic_write(os.path.join(self.path, _ARTIFACTS), data)
        _atomic_write(os.path.join(self.path, _META), json.dumps(meta, indent=1).encode())
        return True

    # -- activation ----------------------------------------------------------------------------

    def close(self) -> None:
        """Give ``TORCHINDUCTOR_CACHE_DIR`` its previous value back."""
        if not self._env_set:
            return
        if self._saved_env is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = self._saved_env
        self._env_set = False

    def clear(self) -> None:
        """Delete this entry (both forms)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> CacheRestore:
        return self.restore()

    def __exit__(self, *exc: object) -> None:
        self.close()
