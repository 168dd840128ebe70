"""Inductor's CPU vector-ISA probe, recorded once per host and toolchain in the compile cache.

Before its first CPU kernel, Inductor decides which vector ISAs it may generate code for
(``torch._inductor.cpu_vec_isa.valid_vec_isa_list``, cached for the process): for every ISA the
CPU's flags allow (on x86: AVX-512 with VNNI, AVX-512, AVX2) it compiles a small test library into
its cache directory and ``dlopen`` s it in a child Python, and for some ISAs it also compiles and
loads a second, intrinsics-only test (AVX-512 BF16, VNNI). torch 2.13 runs every child at every
process start (about 1 s each for the tests that link ``libtorch_cpu``); torch 2.14 skips the child
when its cache directory holds a ``.load_ok`` marker from an earlier run.

:func:`restore_vec_isa` keeps that answer in the compile cache's root (``vec-isa-<key>.json``),
keyed by everything that decides it: the torch version and install, the Python executable that
runs the probe child, ``sys.platform``, ``platform.machine()``, the CPU flags Inductor reads, the
C++ compiler Inductor would use (its resolved path, size and modification time) and the Inductor
settings and environment that reach the test build and load. The first job probes as Inductor
always does and writes the record; a later job whose key matches, and whose record says every ISA
the flags allow passed, answers every test Inductor runs while it computes its list (the base
tests and the intrinsics-only ones, each named by the ISA, its compiler flags at the time and a
hash of the test's source) with the first job's "passed": no test library is built and no child
is started, and Inductor's process-wide cache holds the list (and the per-ISA details such as
AVX-512 BF16 support, which decide the generated code's flags) a probe would have produced. A test
the record does not hold as passed runs for real. The answers are given by an attribute set on
Inductor's ISA objects for that one computation and removed at once; another thread asking one of
those objects to build a test meanwhile gets the recorded answer.

A record that does not match is not used (the job probes and writes its own); a corrupt one (or
one another user owns, or that others may write) is ignored with a warning, and the job probes. A
record where some ISA failed is never used: the job probes, as without a record.
``FASTINIT_VEC_ISA_RECORD=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from fastinit import knobs
from fastinit.warmup._files import atomic_write, untrusted

logger = logging.getLogger(__name__)

__all__ = ["VecIsaRestore", "restore_vec_isa", "vec_isa_key"]

_FORMAT = 2  # 2: every test's outcome (base and intrinsics-only), not only the base ones
_PREFIX = "vec-isa-"
#: Environment variables that reach the probe's test build or its ``dlopen``.
_ENV = (
    "LD_LIBRARY_PATH",
    "TORCHINDUCTOR_DEBUG_COMPILE",
    "TORCHINDUCTOR_DEBUG_SYMBOL",
    "OMP_PREFIX",
    "CONDA_PREFIX",
    "TORCH_INDUCTOR_INSTALL_GXX",
)
_LOCK = threading.Lock()


@dataclasses.dataclass(slots=True)
class VecIsaRestore:
    """What :func:`restore_vec_isa` did."""

    status: str
    """"recorded" (the record answered the base probes), "probed" (probed; the record written),
    "probed-unsaved" (probed; the record could not be written), or "skipped" (see ``reason``)."""
    isas: list[str] = dataclasses.field(default_factory=list)
    """Inductor's valid ISAs, as it names them (empty when skipped)."""
    seconds: float = 0.0
    reason: str = ""


def _compiler() -> dict[str, Any] | None:
    """The C++ compiler Inductor's search would pick (``config.cpp.cxx``), identified by its
    resolved path, size and modification time; None when it cannot be told without running it."""
    from torch._inductor import config

    search = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    for cxx in search:
        if cxx is None:
            if os.getenv("TORCH_INDUCTOR_INSTALL_GXX"):
                return None  # Inductor may install a compiler: not ours to predict
            continue
        found = shutil.which(str(cxx))
        if found is None:
            continue
        real = os.path.realpath(found)
        st = os.stat(real)
        return {
            "search": [str(c) for c in search],
            "path": found,
            "real": real,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
        }
    return None


def vec_isa_key() -> dict[str, Any] | None:
    """Everything that decides Inductor's ISA probe here, or None where the record does not apply
    (not Linux on x86, no compiler found, Inductor configured to skip or fake the probe)."""
    import torch
    from torch._inductor import config, cpu_vec_isa

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if config.is_fbcode() or config.cpp.vec_isa_ok is not None:
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    cpu = torch.cpu
    return {
        "format": _FORMAT,
        "torch": torch.__version__,
        "torch_dir": os.path.dirname(os.path.abspath(torch.__file__)),
        "python": sys.executable,
        "platform": sys.platform,
        "machine": platform.machine(),
        "cpu": list(cpu_vec_isa.x86_isa_checker()),
        "avx512_bf16": bool(cpu._is_avx512_bf16_supported()),
        "amx_fp16": bool(getattr(cpu, "_is_amx_fp16_supported", lambda: False)()),
        "compiler": compiler,
        "config": {
            name: getattr(config.cpp, name, None)
            for name in (
                "march",
                "enable_unsafe_math_opt_flag",
                "enable_floating_point_contract_flag",
            )
        },
        "env": {name: os.environ.get(name) for name in _ENV},
    }


def _allowed(cpu_flags: list[str]) -> list[str]:
    """The ISAs Inductor probes for these CPU flags, in its order."""
    from torch._inductor import cpu_vec_isa

    return [
        str(isa)
        for isa in cpu_vec_isa.supported_vec_isa_list
        if all(flag in cpu_flags for flag in str(isa).split())
    ]


def _read(path: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """The record at ``path`` if it is for ``key``; None if absent or for another key.

    Raises:
        ValueError: corrupt, not a regular file, or not trusted.
    """
    if not os.path.lexists(path):
        return None
    why = untrusted(path)
    if why is not None:
        raise ValueError(why)
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError("not a regular file")
    with open(path, "rb") as f:
        record = json.loads(f.read())
    if not isinstance(record, dict) or not isinstance(record.get("key"), dict):
        raise ValueError("no key")
    for field in ("allowed", "passed"):
        value = record.get(field)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{field} is not a list of names")
    checks = record.get("checks")
    if not isinstance(checks, list) or not all(
        isinstance(c, dict) and isinstance(c.get("id"), list) and len(c["id"]) == 3
        and all(isinstance(v, str) for v in c["id"]) and isinstance(c.get("ok"), bool)
        for c in checks
    ):  # fmt: skip
        raise ValueError("checks is not a list of tests")
    if record["key"] != key:
        return None
    return record


def _record_path(root: str, key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return os.path.join(root, f"{_PREFIX}{digest[:32]}.json")


def restore_vec_isa(root: str | None, *, write: bool = True) -> VecIsaRestore:
    """Fill Inductor's process-wide list of valid CPU vector ISAs, from the record in the compile
    cache ``root`` when one matches (see the module docstring), else by Inductor's own probe
    (then writing the record, unless ``write`` is False). A failure is "skipped" (Inductor
    probes when it needs to). Call it before the first CPU kernel is compiled or loaded; once the
    list is computed in this process, it is "skipped".

    Raises:
        ValueError: ``FASTINIT_VEC_ISA_RECORD`` is neither ``on`` nor ``off`` (a typo in a knob
            is an error, as for every knob; nothing else raises).
    """
    start = time.perf_counter()
    use_record = knobs.get_vec_isa_record()
    with _LOCK:
        try:
            out = _restore(root, write, use_record)
        except Exception as e:  # noqa: BLE001 - best effort: Inductor probes on its own
            out = VecIsaRestore(status="skipped", reason=f"{type(e).__name__}: {e}")
    out.seconds = time.perf_counter() - start
    logger.info(
        "fastinit: CPU vector ISAs %s (%s%s, %.2fs)",
        out.isas,
        out.status,
        f": {out.reason}" if out.reason else "",
        out.seconds,
    )
    return out


def _restore(root: str | None, write: bool, use_record: bool) -> VecIsaRestore:
    if root is None:
        return VecIsaRestore(status="skipped", reason="no compile cache")
    if not use_record:
        return VecIsaRestore(status="skipped", reason="FASTINIT_VEC_ISA_RECORD=off")
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return VecIsaRestore(status="skipped", reason="already known in this process")
    key = vec_isa_key()
    if key is None:
        return VecIsaRestore(status="skipped", reason="not applicable here")
    allowed = _allowed(key["cpu"])
    path = _record_path(root, key)
    try:
        record = _read(path, key)
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(
            f"fastinit: ignoring corrupt CPU vector-ISA record {path} ({type(e).__name__}: {e}); "
            "Inductor probes the ISAs",
            RuntimeWarning,
            stacklevel=3,
        )
        record = None
    if record is not None and record["allowed"] == allowed and record["passed"] == allowed:
        passed = {tuple(c["id"]) for c in record["checks"] if c["ok"]}  # (3 strings: _read)

        def replay(isa: Any, code: str, real: Any) -> bool:
            return _check_id(isa, code) in passed or bool(real(code))

        with _answering(cpu_vec_isa, replay):
            isas = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        # A test the record did not hold as passed ran for real: a failure there (that the key
        # did not foresee) shows here, and the list holds what it answered.
        reason = "" if isas == allowed else f"recorded {allowed}, the tests run now passed {isas}"
        return VecIsaRestore(status="recorded", isas=isas, reason=reason)
    _build_share(cpu_vec_isa, allowed)
    checks: list[dict[str, Any]] = []

    def run(isa: Any, code: str, real: Any) -> bool:
        ok = bool(real(code))
        checks.append({"id": list(_check_id(isa, code)), "ok": ok})
        return ok

    with _answering(cpu_vec_isa, run):
        isas = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    if not write:
        return VecIsaRestore(status="probed-unsaved", isas=isas, reason="read-only cache")
    data = {
        "key": key,
        "allowed": allowed,
        "passed": isas,
        "checks": checks,
        "created": time.time(),
    }
    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError as e:
        return VecIsaRestore(status="probed-unsaved", isas=isas, reason=f"{type(e).__name__}: {e}")
    return VecIsaRestore(status="probed", isas=isas)


def _build_share(cpu_vec_isa: Any, allowed: list[str]) -> None:
    """Where several local ranks probe at once (a cold start: no record yet), build this
    rank's share of the base tests ahead of Inductor's own pass.

    Inductor builds each test under a file lock and reuses a library already built, so the
    local ranks of a host that probe together otherwise queue behind one another for every
    build (about 2 s each here), one core busy. Local rank ``r`` of ``L`` first builds the
    base tests ``[r·n/L, (r+1)·n/L)`` of the ``n`` allowed (rank 0 none: its pass starts at the
    front): the builds run side by side, and each rank's pass then finds the others' built
    (it still loads each one itself, as Inductor does). Only the base test, whose source and
    flags are exactly those of Inductor's pass; a failure here is left to that pass."""
    try:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return
    config = cpu_vec_isa.config
    if ranks < 2 or not 0 < rank < ranks or config.cpp.vec_isa_ok is not None:
        return
    if config.is_fbcode():
        return
    isas = [isa for isa in cpu_vec_isa.supported_vec_isa_list if str(isa) in allowed]
    n = len(isas)
    for isa in isas[rank * n // ranks : (rank + 1) * n // ranks]:
        try:
            isa.check_build(cpu_vec_isa.VecISA._avx_code)
        except Exception as e:  # noqa: BLE001 - Inductor's pass builds it and decides
            logger.debug("fastinit: building the %s test ahead failed: %s", isa, e)


def _check_id(isa: Any, code: str) -> tuple[str, str, str]:
    """A test Inductor runs: the ISA, its compiler flags at the time, the test source's hash."""
    return (str(isa), str(isa.build_arch_flags()), hashlib.sha256(code.encode()).hexdigest())


@contextlib.contextmanager
def _answering(cpu_vec_isa: Any, answer: Any) -> Iterator[None]:
    """While Inductor computes its ISA list: each ISA object's ``check_build(code)`` is
    ``answer(isa, code, real)`` (``real``: Inductor's own test). The attributes are removed on
    exit (Inductor's classes are never touched)."""
    isas = list(cpu_vec_isa.supported_vec_isa_list)
    installed = []
    try:
        for isa in isas:
            if "check_build" in vars(isa):
                continue  # someone else's: leave it alone
            real = isa.check_build
            isa.check_build = functools.partial(answer, isa, real=real)
            installed.append(isa)
        yield
    finally:
        for isa in installed:
            vars(isa).pop("check_build", None)
