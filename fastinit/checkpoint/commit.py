"""The commit: a save becomes a checkpoint once, all or nothing, by one create-only marker.

Rank 0 commits. While the trainers live, ``SaveHandle.wait()`` gathers every rank's "my files
are durable" and its manifest digest in one all_gather; rank 0 then writes the marker and
broadcasts the verdict. When that path is not available (a trainer died after its ``save``
returned, or the collective timed out), the verdict comes from the files: rank 0 (its trainer,
or its writer process once the trainer is gone) waits for every rank's manifest
(:func:`gather_manifests`) and commits or aborts; every other rank waits for the marker or the
abort record (:func:`await_verdict`). Both paths write the same marker, and the marker is
created at most once (:func:`~fastinit.checkpoint.format.create_json_once`), so a second job or
a second save racing into the directory cannot replace it: it is told it lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence

from fastinit import _faults
from fastinit.checkpoint import format as fmt
from fastinit.checkpoint.digest import digest
from fastinit.errors import Taken

__all__ = [
    "Taken",
    "FAILED_FILE",
    "commit",
    "abort",
    "gather_manifests",
    "await_verdict",
    "write_failure",
]


#: Left in a part's directory by a writer that failed (the error), so the file path learns it.
FAILED_FILE = "fastinit-failed.json"
_POLL_S = 0.02
_POLL_MAX_S = 0.25


def commit(
    checkpoint_dir: str,
    save_id: str,
    *,
    index_digest: str,
    manifests: Sequence[str | None],
    replicated: str,
    torch_version: str,
    job: str,
) -> None:
    """Create the commit marker of save ``save_id`` (rank 0).

    Raises:
        CheckpointError: the directory was committed by another save (nothing is replaced),
            or the marker could not be written (a full disk: nothing is committed).
    """
    marker = fmt.Commit(
        save_id=save_id,
        index_digest=index_digest,
        world_size=len(manifests),
        manifests=list(manifests),
        replicated=replicated,
        torch_version=torch_version,
        job=job,
    )
    path = os.path.join(checkpoint_dir, fmt.COMMIT_FILE)
    try:
        _faults.point("checkpoint.marker", rank=0)
        created, data = fmt.create_json_once(path, marker.to_json())
    except OSError as e:
        raise fmt.CheckpointError(
            f"writing the commit marker of {checkpoint_dir} failed ({e}); nothing was committed"
        ) from e
    if created or _save_of(data) == save_id:
        return  # committed (or committed already, by this save's other path)
    holder = _holder(data, path)
    raise Taken(
        f"{checkpoint_dir} was committed by another save ({holder}) while this one was being "
        "written (two jobs, or two saves, into one directory): this save is not committed and "
        "the checkpoint there is left as it is"
    )


def _save_of(data: bytes) -> str | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj.get("save_id") if isinstance(obj, dict) else None


def _holder(data: bytes, path: str) -> str:
    try:
        obj = json.loads(data)
        return f"save {obj.get('save_id')} of job {obj.get('job') or '?'}"
    except (ValueError, AttributeError):
        return f"an unreadable marker at {path}"


def abort(checkpoint_dir: str, save_id: str, reason: str) -> None:
    """Record that save ``save_id`` failed (best effort: a full disk may refuse even this)."""
    with contextlib.suppress(OSError):
        fmt.write_json_atomic(
            fmt.abort_file(checkpoint_dir, save_id),
            {"format": fmt.FORMAT, "save_id": save_id, "reason": reason[:4000]},
        )


def write_failure(part_dir: str, error: str) -> None:
    """A writer's failure, where rank 0's file path will see it (best effort)."""
    try:
        os.makedirs(part_dir, exist_ok=True)
        fmt.write_json_atomic(os.path.join(part_dir, FAILED_FILE), {"error": error[:4000]})
    except OSError:
        pass


def _sleep(waited: float) -> None:
    time.sleep(min(_POLL_MAX_S, _POLL_S * (1 + waited)))


def gather_manifests(
    checkpoint_dir: str, save_id: str, world_size: int, *, timeout: float
) -> list[str]:
    """Every rank's manifest digest of save ``save_id``, read from the files as the writers
    finish them; waits while ranks make progress (``timeout``: the longest wait for the next).

    Raises:
        CheckpointError: a rank's writer failed, or no manifest arrived for ``timeout`` seconds.
    """
    data_dir = os.path.join(checkpoint_dir, fmt.data_dir_name(save_id))
    digests: list[str | None] = [None] * world_size
    pending = set(range(world_size))
    last = time.monotonic()
    start = last
    while pending:
        progressed = False
        for rank in sorted(pending):
            part = os.path.join(data_dir, fmt.RANK_DIR_PATTERN.format(rank=rank))
            failed = os.path.join(part, FAILED_FILE)
            if os.path.exists(failed):
                raise fmt.CheckpointError(
                    f"saving {checkpoint_dir} failed on rank {rank}: "
                    f"{_reason(failed)}; nothing was committed"
                )
            try:
                with open(os.path.join(part, fmt.MANIFEST_FILE), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            try:
                manifest = fmt.Manifest.from_json(json.loads(data), part)
            except (ValueError, fmt.CheckpointError):
                continue  # being replaced right now: read it again
            if manifest.save_id != save_id:
                raise fmt.CheckpointError(f"{part}: a manifest of another save")
            digests[rank] = digest(data)
            pending.discard(rank)
            progressed = True
        if progressed:
            last = time.monotonic()
        elif pending and time.monotonic() - last > timeout:
            missing = sorted(pending)
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise fmt.CheckpointError(
                f"saving {checkpoint_dir}: no files from rank(s) {shown} for {timeout:g}s "
                "(a trainer died before its save returned, or its writer is stuck); nothing was "
                "committed"
            )
        if pending:
            _sleep(time.monotonic() - start)
    return [d for d in digests if d is not None]


def _reason(path: str, key: str = "error") -> str:
    """What the failure (``key="error"``) or abort (``key="reason"``) record at ``path`` says."""
    try:
        with open(path, "rb") as f:
            return str(json.loads(f.read()).get(key, "unknown"))
    except (OSError, ValueError, AttributeError):
        return f"unknown (the record {os.path.basename(path)} is unreadable)"


def await_verdict(checkpoint_dir: str, save_id: str, *, timeout: float) -> None:
    """Wait until save ``save_id`` is committed (return) or failed (raise), from the files.

    Raises:
        CheckpointError: the save was aborted, the directory was committed by another save, or
            no verdict appeared within ``timeout`` seconds.
    """
    marker = os.path.join(checkpoint_dir, fmt.COMMIT_FILE)
    aborted = fmt.abort_file(checkpoint_dir, save_id)
    start = time.monotonic()
    while True:
        try:
            with open(marker, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = None
        if data:
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None  # the non-atomic fallback, still being written
            if isinstance(obj, dict):
                if obj.get("save_id") == save_id:
                    return
                raise fmt.CheckpointError(
                    f"{checkpoint_dir} was committed by another save ({_holder(data, marker)}): "
                    "this save is not committed"
                )
        if os.path.exists(aborted):
            raise fmt.CheckpointError(
                f"saving {checkpoint_dir} failed: {_reason(aborted, 'reason')}; nothing was "
                "committed"
            )
        waited = time.monotonic() - start
        if waited > timeout:
            raise fmt.CheckpointError(
                f"saving {checkpoint_dir}: no verdict from rank 0 within {timeout:g}s "
                "(FASTINIT_COLLECTIVE_TIMEOUT); it is not committed"
            )
        _sleep(waited)
