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
forward + backward, fresh process each (``python -m benchmarks.warmup``, 2 shared cores):
cold compile 18.8 s, MegaCache loaded into an empty Inductor directory 22.0 s (no gain: dynamo and
AOTAutograd still run, and the C++ is rebuilt), warm Inductor directory 4.4 s. (Earlier, on a
quieter machine: 10-15 s, 9.1 s, 1.3 s.) When the Inductor directory is warm the
MegaCache file is not loaded at all; it is loaded when the directory is missing (a new host).

Files are written atomically (temporary file + ``os.replace``); ``meta.json`` is written last and
holds the artifacts' SHA-256, so a torn or corrupt entry is detected, ignored with a warning and
replaced by the next save. Concurrent writers with the same key write identical content.

On CPU, :meth:`CompileCache.restore` also answers Inductor's CPU vector-ISA probe from a record
in the cache root (``vec-isa-<key>.json``, written by the first job that probed; see
:mod:`fastinit.warmup.vec_isa`), so a warm restart does not compile and load test libraries.

**The cache is code.** What it holds is compiled code (C++/Triton kernels, Python wrappers) that
the next job loads and runs. Only the job's own user may be able to write the directory: entries
are created owner-only (directories 0o700, files 0o600), and an entry (or root) that another user
owns or that group/others may write is not used (a warning, then a miss). Never point it at a
directory other users can write.

**Read-only entries.** A cache on a read-only mount (a shared cache, as clusters mount it) is
read, never written: Inductor writes lock files (``inductor/locks/*.lock``) and new graphs into its
cache directory even when it only reads, so a read-only entry's Inductor directory is copied into
a private temporary directory that Inductor uses instead (removed by :meth:`CompileCache.close`);
:meth:`CompileCache.save` writes nothing (one warning when the entry did not serve the compile).
A read-only root without this job's entry is a miss with one warning.

**Hit means used.** :meth:`CompileCache.restore` never raises for what it finds (an unusable
root or entry is a logged miss; only a mistyped ``FASTINIT_VEC_ISA_RECORD`` is a ``ValueError``,
as every knob's typo is) and cannot know yet whether the entry will serve the compile; it returns a
:class:`CacheRestore` with status "pending" when something was restored. After the first compiled
step, :meth:`CompileCache.confirm` (also called on ``__exit__``) sets it to "hit" only if Inductor
actually served compiled graphs from the cache (its FX-graph cache hit counter grew), else "miss".

Example::

    config = CompileConfig(targets=("model.dense_arch", "model.over_arch"))
    cache = CompileCache.for_targets(dmp, config)
    with cache as restored:  # TORCHINDUCTOR_CACHE_DIR points into the entry until exit
        warm_up(dmp, batch, config=WarmupConfig(compile=config))
        cache.save()
    print(restored.status)   # "hit" or "miss" (or "corrupt", "off")
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from fastinit import knobs
from fastinit.warmup._files import atomic_write, nonempty, private_dir, untrusted, writable

if TYPE_CHECKING:
    from torch import nn

    from fastinit.warmup.targets import CompileConfig

logger = logging.getLogger(__name__)

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
_PRECOMPILED = "precompiled"
_PRECOMPILED_META = "precompiled.json"
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
    """After :meth:`CompileCache.confirm`: "hit" (Inductor served compiled graphs from the
    entry) or "miss". Straight from ``restore()``: "pending" (something was restored; not yet
    known to be used), "miss", "corrupt" (ignored with a warning) or "off"."""
    artifacts_loaded: bool = False
    """The MegaCache file was loaded into the Inductor caches."""
    inductor_warm: bool = False
    """The entry's Inductor directory already held compiled code."""
    seconds: float = 0.0
    """Time spent restoring."""
    cache_hits: int = 0
    """Graphs Inductor served from its cache between restore and confirm."""
    reason: str = ""
    """Why the entry was not used, when it was not."""
    precompiled: int = 0
    """Targets whose precompiled form (:mod:`fastinit.warmup.precompile`) the entry held."""
    precompiled_served: int = 0
    """After :meth:`CompileCache.confirm`: targets whose saved precompiled form served calls
    (no Dynamo trace)."""
    read_only: bool = False
    """The entry could not be written (a read-only mount): Inductor worked on a private copy of
    its directory, and :meth:`CompileCache.save` writes nothing."""
    vec_isa: str = ""
    """On CPU: how Inductor's CPU vector-ISA list was filled (:func:`fastinit.warmup.vec_isa.
    restore_vec_isa`): "recorded" (from the root's record, no probe), "probed", "probed-unsaved"
    or "skipped"; "" when not attempted."""


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


def _cache_hits() -> int:
    """Graphs Inductor (FX-graph cache) and AOTAutograd served from their caches so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]) + int(
        counters["aot_autograd"]["autograd_cache_hit"]
    )


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
        self._restored: CacheRestore | None = None
        self._hits_at_restore = 0
        self._copy: str | None = None
        self._precompiled: dict[str, bytes] = {}
        self._targets: list[Any] = []
        self.read_only = False
        """The entry cannot be written (a read-only mount): it is read, never saved to."""

    @classmethod
    def for_targets(
        cls,
        model: nn.Module,
        compile_config: CompileConfig,
        config: CompileCacheConfig | None = None,
    ) -> CompileCache:
        """The entry for compiling ``compile_config.targets`` of ``model``: the same targets
        :func:`fastinit.warmup.compile_modules` takes (paths in the unwrapped model, or modules),
        fingerprinted with the compile settings (backend, mode, fullgraph, dynamic dimension).
        """
        from fastinit.warmup.targets import resolve_targets

        modules = [module for _, module in resolve_targets(model, compile_config.targets)]
        extra = {
            "targets": [path for path, _ in resolve_targets(model, compile_config.targets)],
            "backend": compile_config.backend,
            "mode": compile_config.mode,
            "fullgraph": compile_config.fullgraph,
            "batch_dim": compile_config.batch_dim,
            "precompile": compile_config.precompile,
        }
        return cls(module_fingerprint(modules, extra), config)

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
    def root(self) -> str | None:
        """The cache's root directory (None when off); entries are its subdirectories."""
        return None if self.path is None else os.path.dirname(self.path)

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
        empty, load the MegaCache file. Never raises: an unusable root or entry (unwritable, not
        a directory, not ours, corrupt) is a miss with a warning, and compilation goes on
        uncached. The status is "pending" until :meth:`confirm` knows whether it was used."""
        start = time.perf_counter()
        if self.path is None:
            return CacheRestore(status="off")
        try:
            restored = self._restore()
        except Exception as e:  # noqa: BLE001 - restore never raises: compile uncached instead
            self.close()
            why = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"fastinit: compile cache {self.path} unusable ({why}); compiling without it",
                RuntimeWarning,
                stacklevel=2,
            )
            restored = CacheRestore(status="miss", reason=why)
        restored.seconds = time.perf_counter() - start
        self._restored = restored
        self._hits_at_restore = _cache_hits()
        return restored

    def _restore(self) -> CacheRestore:
        assert self.path is not None
        root = os.path.dirname(self.path)
        for path in (root, self.path):
            why = untrusted(path)
            if why is not None:
                warnings.warn(
                    f"fastinit: not using compile cache {self.path}: {why} (the cache holds code "
                    "this job would run; only its owner may write it)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return CacheRestore(status="miss", reason=why)
        private_dir(self.path)
        self.read_only = not writable(self.path)
        warm = False
        inductor = self.inductor_path
        if inductor is not None:
            warm = nonempty(inductor)
            if self.read_only:
                # Inductor writes lock files (and new graphs) into its cache directory even when
                # it only reads: give it a private copy of what the entry holds.
                active = self._private_copy(inductor if warm else None)
            else:
                private_dir(inductor)
                active = inductor
            if not self._env_set:
                self._saved_env = os.environ.get(_ENV)
                self._env_set = True
            os.environ[_ENV] = active
        vec_isa = ""
        if self.config.device == "cpu":
            # Before the first artifact is loaded (its kernels ask Inductor for the vector ISA),
            # with Inductor pointed at the entry: a probe builds its test libraries there.
            from fastinit.warmup.vec_isa import restore_vec_isa

            vec_isa = restore_vec_isa(root, write=writable(root)).status
        loaded = False
        corrupt = False
        if self.config.mega_cache and not warm:
            data = self._read_artifacts()
            if isinstance(data, bytes):
                loaded = self._load(data)
                corrupt = not loaded
            elif data is False:
                corrupt = True
        self._precompiled = self._read_precompiled()
        found = bool(self._precompiled)
        status = "corrupt" if corrupt else ("pending" if warm or loaded or found else "miss")
        return CacheRestore(
            status=status,
            artifacts_loaded=loaded,
            inductor_warm=warm,
            read_only=self.read_only,
            precompiled=len(self._precompiled),
            vec_isa=vec_isa,
        )

    # -- precompiled targets -------------------------------------------------------------------

    def precompiled_artifact(self, path: str) -> bytes | None:
        """The saved precompiled form of compile target ``path`` (after :meth:`restore`)."""
        return self._precompiled.get(path)

    def track(self, target: Any) -> None:
        """Register a :class:`fastinit.warmup.precompile.PrecompiledTarget`: :meth:`confirm`
        counts what it served, :meth:`save` writes what it compiled."""
        self._targets.append(target)

    @property
    def precompiled_targets(self) -> tuple[Any, ...]:
        """The tracked :class:`fastinit.warmup.precompile.PrecompiledTarget` s (``status``,
        ``reason``, calls served)."""
        return tuple(self._targets)

    def _precompiled_meta(self) -> dict[str, Any]:
        """The entry's precompiled index ({} when absent)."""
        assert self.path is not None
        meta_path = os.path.join(self.path, _PRECOMPILED_META)
        if not os.path.lexists(meta_path):
            return {}

        if not stat.S_ISREG(os.lstat(meta_path).st_mode):
            raise ValueError(f"{_PRECOMPILED_META} is not a regular file")
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read())
        if not isinstance(meta, dict) or meta.get("key") != self.key_fields:
            raise ValueError("precompiled index: key fields differ from this job's")
        if not isinstance(meta.get("targets"), dict):
            raise ValueError("precompiled index has no targets")
        return meta

    def _read_precompiled(self) -> dict[str, bytes]:
        """Every verified precompiled form; a corrupt one is dropped with a warning."""
        assert self.path is not None
        try:
            meta = self._precompiled_meta()
        except (OSError, ValueError, TypeError, AttributeError) as e:
            self._discard_precompiled(f"{type(e).__name__}: {e}")
            return {}
        out: dict[str, bytes] = {}

        for path, entry in meta.get("targets", {}).items():
            try:
                file = os.path.join(self.path, _PRECOMPILED, os.path.basename(str(entry["file"])))
                if not stat.S_ISREG(os.lstat(file).st_mode):
                    raise ValueError(f"{file} is not a regular file")
                with open(file, "rb") as f:
                    data = f.read()
                if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
                    raise ValueError("checksum mismatch")
            except (OSError, ValueError, TypeError, KeyError) as e:
                warnings.warn(
                    f"fastinit: ignoring precompiled {path} in {self.path} "
                    f"({type(e).__name__}: {e}); compiling it",
                    RuntimeWarning,
                    stacklevel=4,
                )
                continue
            out[str(path)] = data
        return out

    def _discard_precompiled(self, why: str) -> None:
        assert self.path is not None
        warnings.warn(
            f"fastinit: ignoring corrupt precompiled index in {self.path} ({why}); compiling",
            RuntimeWarning,
            stacklevel=4,
        )
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.path, _PRECOMPILED_META))

    def _save_precompiled(self) -> bool:
        """Write what tracked targets compiled ahead of time in this job; the index last."""
        assert self.path is not None
        fresh = {t.path: data for t in self._targets if (data := t.serialize()) is not None}
        if not fresh:
            return False
        try:
            meta = self._precompiled_meta()
        except (OSError, ValueError, TypeError, AttributeError):
            meta = {}
        targets = dict(meta.get("targets", {}))
        for path, data in fresh.items():
            # Named by content: ranks saving at once write different bytes (pickles of the same
            # code), each index names its own files, and the last index written wins whole.
            digest = hashlib.sha256(data).hexdigest()
            name = digest[:32] + ".bin"
            atomic_write(os.path.join(self.path, _PRECOMPILED, name), data)
            targets[path] = {"file": name, "sha256": digest, "bytes": len(data)}
        index = {"key": self.key_fields, "targets": targets, "created": time.time()}
        atomic_write(
            os.path.join(self.path, _PRECOMPILED_META), json.dumps(index, indent=1).encode()
        )
        return True

    def _private_copy(self, inductor: str | None) -> str:
        """A private, writable Inductor directory holding a copy of ``inductor`` (None: empty);
        removed by :meth:`close`."""
        self._drop_copy()
        copy = tempfile.mkdtemp(prefix="fastinit-inductor-")
        self._copy = copy
        if inductor is not None:
            shutil.copytree(
                inductor,
                copy,
                symlinks=True,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("locks", ".tmp*"),
            )
        logger.info(
            "fastinit: compile cache %s is read-only; Inductor uses a private copy in %s",
            self.path,
            copy,
        )
        return copy

    def _drop_copy(self) -> None:
        if self._copy is not None:
            shutil.rmtree(self._copy, ignore_errors=True)
            self._copy = None

    def confirm(self) -> CacheRestore | None:
        """After the first compiled step: did the restored entry serve the compile?

        Sets the status of what :meth:`restore` returned (the same object) to "hit" when Inductor
        or AOTAutograd served at least one graph from the cache since the restore, else "miss"
        (e.g. junk in the Inductor directory, or code for other modules). Returns it (None before
        any restore).
        """
        restored = self._restored
        if restored is None or restored.status not in ("pending", "hit", "miss"):
            return restored
        if restored.status == "miss" and restored.reason:
            return restored
        try:
            hits = _cache_hits() - self._hits_at_restore
        except Exception:  # noqa: BLE001 - counters unavailable: cannot claim a hit
            hits = 0
        restored.cache_hits = hits
        served = sum(1 for t in self._targets if t.status == "hit")
        restored.precompiled_served = served
        restored.status = "hit" if hits > 0 or served > 0 else "miss"
        if (
            hits == 0
            and served == 0
            and (restored.inductor_warm or restored.artifacts_loaded or restored.precompiled)
        ):
            restored.reason = "restored artifacts were not used by the compiler"
            logger.info("fastinit: compile cache %s: %s", self.path, restored.reason)
        return restored

    def _read_artifacts(self) -> bytes | Literal[False] | None:
        """The verified artifacts; None if absent; False if corrupt (and the entry discarded)."""
        assert self.path is not None
        meta_path = os.path.join(self.path, _META)
        data_path = os.path.join(self.path, _ARTIFACTS)
        if not os.path.exists(meta_path):
            return None
        try:
            for path in (meta_path, data_path):
                if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block open()
                    raise ValueError(f"{os.path.basename(path)} is not a regular file")
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
        its metadata, atomically, and the precompiled targets this job compiled ahead of time
        (:mod:`fastinit.warmup.precompile`). Returns False when the cache is off or there is
        nothing to save.
        """
        if self.path is None:
            return False
        if self.read_only:
            restored = self._restored
            if restored is None or restored.status != "hit":
                warnings.warn(
                    f"fastinit: compile cache {self.path} is read-only; this job's compiled "
                    "artifacts are not saved",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return False
        try:
            precompiled = self._save_precompiled()
        except OSError as e:
            warnings.warn(
                f"fastinit: could not save precompiled targets in {self.path} "
                f"({type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=2,
            )
            precompiled = False
        if not self.config.mega_cache:
            return precompiled
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return precompiled
        data, _info = saved
        if not data:
            return precompiled
        meta = {
            "key": self.key_fields,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "created": time.time(),
        }
        try:
            atomic_write(os.path.join(self.path, _ARTIFACTS), data)
            atomic_write(os.path.join(self.path, _META), json.dumps(meta, indent=1).encode())
        except OSError as e:
            warnings.warn(
                f"fastinit: could not save compile cache {self.path} ({type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        return True

    # -- activation ----------------------------------------------------------------------------

    def close(self) -> None:
        """Give ``TORCHINDUCTOR_CACHE_DIR`` its previous value back (and remove the private copy
        of a read-only entry's Inductor directory)."""
        self._drop_copy()
        if not self._env_set:
            return
        if self._saved_env is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = self._saved_env
        self._env_set = False

    def clear(self) -> None:
        """Delete this entry (every form)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> CacheRestore:
        return self.restore()

    def __exit__(self, *exc: object) -> None:
        try:
            self.confirm()
        finally:
            self.close()
