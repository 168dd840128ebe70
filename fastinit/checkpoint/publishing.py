"""Publishing a model from a checkpoint: on a CPU host, apart from training, read-only.

The training job saves checkpoints of the *sharded* model (every rank its shards). Serving wants
the *unsharded* model in a format a serving stack reads. :func:`publish` runs as a separate job
(a world of one, no process group, no GPU), while training goes on:

1. builds the unsharded model (the user's factory: the model as it is before ``fastinit.setup``);
2. loads the checkpoint of any world size into it — the resharded path: every stored shard is read
   into its slice of the full tensor (DCP's resharding for a checkpoint with DCP's global
   ``.metadata``; ``fastinit.checkpoint.load`` for one without, where the package has it);
3. writes the ``state_dict`` (``model.safetensors`` where the ``safetensors`` package is installed,
   else ``model.pt`` with ``torch.save``) and the dense part via ``torch.export`` (every largest
   submodule holding no embedding table, with the inputs it received in the verifying forward
   pass, the batch dimension dynamic where it can be: ``dense/<path>.pt2``; what does not export
   is reported, not fatal);
4. verifies: a forward pass on the batch the trainer recorded at save time
   (:func:`record_verification`, a small file beside the checkpoint's shards) gives the output
   the trainer recorded, and every exported program gives its module's output.

The checkpoint is only read: nothing is written inside it, the output goes to a fresh directory
(written under a temporary name, renamed at the end; an existing non-empty one is refused).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastinit.checkpoint.loading import load
from fastinit.errors import PublishError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "VERIFY_FILE",
    "PublishError",
    "PublishReport",
    "record_verification",
    "load_unsharded",
    "publish",
]

logger = logging.getLogger("fastinit.checkpoint")

#: The trainer's recorded batch and output, inside the checkpoint directory.
VERIFY_FILE = "fastinit-verify.pt"


@dataclasses.dataclass(kw_only=True, slots=True)
class PublishReport:
    """What :func:`publish` wrote and checked."""

    checkpoint: str
    out: str
    load: str
    """How the checkpoint was read ("dcp resharded", "fastinit.checkpoint.load")."""
    tensors: int
    bytes: int
    state_dict_file: str
    format: str
    """"safetensors" or "torch.save"."""
    exported: dict[str, str] = dataclasses.field(default_factory=dict)
    """Submodule path -> ``.pt2`` file of its ``torch.export`` program."""
    export_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    """Submodule path -> why it did not export."""
    verified: bool | None = None
    """The forward on the recorded batch gave the recorded output (None: nothing recorded)."""
    not_verified: str | None = None
    """When ``verified`` is None: what could not be checked, and why."""
    max_abs_diff: float | None = None
    """Largest difference against the recorded output (and the exported programs' against
    their modules)."""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)


# -- the trainer's side ---------------------------------------------------------------------


def _to_cpu(obj: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    if hasattr(obj, "to") and not isinstance(obj, torch.Tensor):
        try:
            return obj.to(torch.device("cpu"))
        except TypeError:
            pass
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, obj)


def record_verification(
    checkpoint_dir: str, batch: Any, output: Any, *, training: bool = True, rank: int = 0
) -> str | None:
    """Keep a batch and the model's output on it beside a checkpoint, for :func:`publish` to
    verify against. Call it on every rank; only ``rank`` 0 writes (atomically).

    The output must come from the checkpoint's state: in a training loop that saved after step
    K, the output of step K + 1's forward (its parameters are the checkpoint's) on the batch
    step K + 1 trained on.

    Args:
        checkpoint_dir: the checkpoint's directory.
        batch: the model's input (any picklable object; tensors are moved to the CPU).
        output: the model's output on it (a tensor or a structure of tensors).
        training: whether the output came from the model in training mode (publish runs the
            forward in the same mode).
        rank: this process's rank.

    Returns:
        The file written, or None on other ranks.
    """
    import torch

    if rank != 0:
        return None
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, VERIFY_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    record = {"batch": _to_cpu(batch), "output": _to_cpu(output), "training": training}
    torch.save(record, tmp)
    os.replace(tmp, path)
    return path


# -- loading into the unsharded model -----------------------------------------------------------


def load_unsharded(checkpoint_dir: str, model: nn.Module) -> str:
    """Load a checkpoint of any world size and plan into the unsharded ``model`` in place, on a
    world of one (no process group); returns how it was read.

    Raises:
        PublishError: no checkpoint there, or its tensors do not fit the model's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not os.path.isdir(checkpoint_dir):
        raise PublishError(f"{checkpoint_dir}: no such checkpoint directory")
    if not os.path.exists(os.path.join(checkpoint_dir, ".metadata")):
        try:
            report = load(checkpoint_dir, model)
        except Exception as e:  # noqa: BLE001 - CheckpointError and what DCP raises
            raise PublishError(f"{checkpoint_dir} does not fit the model: {e}") from e
        return f"fastinit.checkpoint.load ({getattr(report, 'mode', '?')})"
    state = {"model": model.state_dict()}
    try:
        dcp.load(
            state,
            storage_reader=dcp.FileSystemReader(checkpoint_dir),
            no_dist=True,
        )
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise PublishError(f"{checkpoint_dir} does not fit the model: {first}") from e
    model.load_state_dict(state["model"])
    return "dcp resharded"


# -- writing ------------------------------------------------------------------------------------


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            logger.warning("publish: %s is not a tensor; not written", name)
            continue
        t = value.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():  # tied weights: safetensors wants each storage once
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _write_state_dict(tensors: Mapping[str, torch.Tensor], out: str) -> tuple[str, str]:
    try:
        from safetensors.torch import save_file
    except ImportError:
        import torch

        path = os.path.join(out, "model.pt")
        torch.save(dict(tensors), path)
        return path, "torch.save"
    path = os.path.join(out, "model.safetensors")
    save_file(dict(tensors), path, metadata={"format": "pt", "written_by": "fastinit publish"})
    return path, "safetensors"


def _is_sparse(module: nn.Module) -> bool:
    import torch

    names = ("EmbeddingBagCollectionInterface", "EmbeddingCollectionInterface")
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag):
            return True
        if any(c.__name__ in names for c in type(m).__mro__):
            return True
    return False


def _dense_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The largest submodules holding parameters and no embedding table."""
    if not _is_sparse(model):
        return [("", model)]
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if not _is_sparse(child):
                if any(True for _ in child.parameters()):
                    out.append((path, child))
            else:
                walk(path, child)

    walk("", model)
    return out


def _compare(a: Any, b: Any) -> float:
    """Largest absolute difference between two structures of tensors (inf: they differ in
    structure, shape or dtype)."""
    import torch
    from torch.utils._pytree import tree_flatten

    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    if sa != sb or len(fa) != len(fb):
        return float("inf")
    worst = 0.0
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return float("inf")
        if not isinstance(x, torch.Tensor):
            if x != y:
                return float("inf")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")
        if x.numel():
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    import torch
    from torch.utils._pytree import tree_flatten

    fa, _ = tree_flatten(a)
    fb, _ = tree_flatten(b)
    return all(
        torch.allclose(x.double(), y.double(), rtol=rtol, atol=atol)
        if isinstance(x, torch.Tensor)
        else x == y
        for x, y in zip(fa, fb)
    )


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.export`` with the batch dimension (dim 0 of every tensor input) dynamic where
    it can be, else static."""
    import torch
    from torch.utils._pytree import tree_map

    def batch_dim(x: Any) -> Any:
        return {0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) and x.ndim else None

    try:
        return torch.export.export(
            module,
            args,
            kwargs,
            dynamic_shapes=(tree_map(batch_dim, args), tree_map(batch_dim, kwargs))
            if kwargs
            else tree_map(batch_dim, args),
        )
    except Exception as e:  # noqa: BLE001 - fall back to the shapes seen
        logger.info("publish: a dynamic batch dimension did not export (%s); static shapes", e)
        return torch.export.export(module, args, kwargs)


def publish(
    checkpoint_dir: str,
    out: str,
    model: nn.Module,
    *,
    batch_file: str | None = None,
    export: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> PublishReport:
    """Publish ``model`` loaded from ``checkpoint_dir`` into the fresh directory ``out``.

    Args:
        checkpoint_dir: the checkpoint (any world size; read only).
        out: the output directory (must not exist or be empty; not inside the checkpoint).
        model: the unsharded model, on the CPU (parameters on "meta" are allocated first).
        batch_file: the recorded batch and output (default: the checkpoint's ``VERIFY_FILE``).
        export: write the dense part via ``torch.export``.
        rtol: the relative tolerance of the verification (the sharded kernels sum in another
            order than the unsharded modules).
        atol: the absolute tolerance of the verification.

    Returns:
        The :class:`PublishReport`; ``verified`` False means the forward on the recorded batch
        did not give the recorded output (the files are still written, for inspection); None
        means nothing was recorded to verify against (``not_verified`` says what was not
        checked; the state_dict is still written).

    Raises:
        PublishError: the output is taken, the checkpoint is missing or does not fit the model,
            ``batch_file`` is not a file.
    """
    import torch

    t0 = time.perf_counter()
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    out = os.path.abspath(out)
    if os.path.commonpath([checkpoint_dir, out]) == checkpoint_dir:
        raise PublishError(f"{out} is inside the checkpoint {checkpoint_dir} (read only)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise PublishError(f"{out} exists and is not empty; nothing overwritten")
    if batch_file is not None and not os.path.isfile(batch_file):
        raise PublishError(f"{batch_file}: no such recorded batch (--batch)")
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model = model.to_empty(device=torch.device("cpu"))
    seconds: dict[str, float] = {}
    how = load_unsharded(checkpoint_dir, model)
    seconds["load"] = time.perf_counter() - t0

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        t = time.perf_counter()
        tensors = _state_tensors(model)
        sd_path, fmt = _write_state_dict(tensors, tmp)
        seconds["state_dict"] = time.perf_counter() - t
        report = PublishReport(
            checkpoint=checkpoint_dir,
            out=out,
            load=how,
            tensors=len(tensors),
            bytes=sum(v.numel() * v.element_size() for v in tensors.values()),
            state_dict_file=os.path.join(out, os.path.basename(sd_path)),
            format=fmt,
        )
        t = time.perf_counter()
        _verify_and_export(model, checkpoint_dir, batch_file, export, tmp, report, rtol, atol)
        seconds["verify_export"] = time.perf_counter() - t
        report.seconds = seconds
        with open(os.path.join(tmp, "publish.json"), "w") as f:
            json.dump(dataclasses.asdict(report), f, indent=1)
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds["total"] = time.perf_counter() - t0
    return report


def _verify_and_export(
    model: nn.Module,
    checkpoint_dir: str,
    batch_file: str | None,
    export: bool,
    tmp: str,
    report: PublishReport,
    rtol: float,
    atol: float,
) -> None:
    import torch

    path = batch_file or os.path.join(checkpoint_dir, VERIFY_FILE)
    parts = _dense_parts(model) if export else []
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    outputs: dict[str, Any] = {}
    record = None
    if os.path.exists(path):
        record = torch.load(path, weights_only=False)  # the job's own file: a pickled batch

    def hook_for(path: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            inputs.setdefault(path, (args, kwargs))
            outputs.setdefault(path, output)

        return hook

    hooks = [m.register_forward_hook(hook_for(n), with_kwargs=True) for n, m in parts]
    try:
        if record is not None:
            model.train(bool(record.get("training", False)))
            with torch.no_grad():
                got = model(record["batch"])
            diff = _compare(got, record["output"])
            report.max_abs_diff = diff
            report.verified = diff != float("inf") and _close(got, record["output"], rtol, atol)
    finally:
        for h in hooks:
            h.remove()
    if record is None:
        report.not_verified = (
            f"the checkpoint holds no recorded batch ({VERIFY_FILE}: the trainer did not call "
            "fastinit.checkpoint.record_verification), so no forward pass checked the loaded "
            "state"
            + (
                " and the dense part was not exported (torch.export needs its inputs)"
                if parts
                else ""
            )
        )
    if not export:
        return
    os.makedirs(os.path.join(tmp, "dense"), exist_ok=True)
    for name, module in parts:
        if name not in inputs:
            report.export_errors[name or "<model>"] = (
                "not called in the verifying forward pass (no recorded batch?)"
            )
            continue
        args, kwargs = inputs[name]
        try:
            program = _export(module, args, kwargs)
            with torch.no_grad():
                got = program.module()(*args, **kwargs)
            diff = _compare(got, outputs[name])
            if diff == float("inf") or not _close(got, outputs[name], rtol, atol):
                raise PublishError(f"the exported program differs from the module ({diff})")
            file = os.path.join("dense", f"{name or 'model'}.pt2")
            torch.export.save(program, os.path.join(tmp, file))
        except Exception as e:  # noqa: BLE001 - whatever stops an export is reported
            report.export_errors[name or "<model>"] = f"{type(e).__name__}: {e}"[:500]
            continue
        report.exported[name or "<model>"] = os.path.join(report.out, file)
        report.max_abs_diff = max(report.max_abs_diff or 0.0, diff)
