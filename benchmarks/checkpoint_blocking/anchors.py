"""What a fastinit save is measured against: stock DCP's best on this host, and torch_checkpointing.

* **stock-best**: ``dcp.async_save`` with the best stager DCP has for TorchRec's state on this
  host. DCP's ``DefaultStager`` (``StagingOptions``: pinned / shared-memory staging, cached
  buffers) refuses TorchRec's ``ShardedTensor`` (torch 2.13 and 2.14: its state-dict stager calls
  ``data_ptr``, which ``ShardedTensor`` does not support). DCP's next best is
  ``BlockingAsyncStager(cache_staged_state_dict=True)`` (buffers allocated by the first save and
  reused); on CUDA that is it. On a host without CUDA it raises (it always asks for pinned
  memory), so there stock-best is the same stager with its cache unpinned (:class:`CachedStager`:
  DCP's own ``_create_cpu_state_dict`` / ``_copy_state_dict``, ``pin_memory=False``).
  :func:`probe_dcp` shows both refusals on a real state.
* **torch_checkpointing** 0.1.1 (meta-pytorch): a writer process, shared-memory staging on a
  thread, a store barrier and a directory rename. Its CPU configuration (its defaults need CUDA):
  no pinned memory, no non-blocking copies, and no ``O_DIRECT`` (``torch.save`` writes unaligned
  records, which ``O_DIRECT`` refuses on ext4). It cannot take TorchRec's ``ShardedTensor`` (its
  stager is DCP's, with the same ``data_ptr`` call): it saves each rank's local shards as plain
  tensors (:func:`local_tensors`), which is enough for a same-plan resume and nothing more
  (no resharding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "CachedStager",
    "dcp_stager",
    "probe_dcp",
    "TORCH_CHECKPOINTING",
    "torch_checkpointing_available",
    "torch_checkpointing_manager",
    "torch_checkpointing_loader",
    "local_tensors",
    "nbytes",
    "refusal",
]

#: The torch_checkpointing release measured (requirements/common.txt pins it).
TORCH_CHECKPOINTING = "0.1.1"


def _cached_stager_class() -> Any:
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    class _CachedStager(BlockingAsyncStager):
        """``BlockingAsyncStager(cache_staged_state_dict=True)`` whose cache is pinned only where
        CUDA is there (DCP's own pins always, which needs CUDA)."""

        def __init__(self) -> None:
            super().__init__(cache_staged_state_dict=True)

        def stage(self, state_dict: Any) -> Any:
            import torch

            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(
                    state_dict, pin_memory=torch.cuda.is_available()
                )
            return _copy_state_dict(state_dict, self.state_dict_cache)

    return _CachedStager


def CachedStager() -> Any:  # noqa: N802 - a class made on first use (torch is imported late)
    """DCP's cached blocking stager, its cache pinned only where CUDA is there."""
    return _cached_stager_class()()


def dcp_stager(device_type: str) -> tuple[Any, str]:
    """Stock-best's stager for TorchRec's state on ``device_type`` and how it is called."""
    if device_type == "cuda":
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager(cache_staged_state_dict=True), (
            "BlockingAsyncStager(cache_staged_state_dict=True)"
        )
    return CachedStager(), (
        "BlockingAsyncStager(cache_staged_state_dict=True) with its cache unpinned "
        "(DCP's own pins, which needs CUDA)"
    )


def refusal(e: BaseException) -> str:
    """What an exception says, in one short line (a ShardedTensor's refusal of a torch function
    without the tensor's repr)."""
    import re

    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    m = re.search(r"torch function '(\w+)'.* not supported for (\w+)", text)
    if m:
        return f"{type(e).__name__}: torch function '{m.group(1)}' not supported for {m.group(2)}"
    return text if len(text) <= 160 else text[:157] + "..."


def probe_dcp(state: Mapping[str, Any]) -> dict[str, str]:
    """What DCP's own stagers say to ``state`` on this host: ``""`` (accepted) or the error.

    ``DefaultStager`` is tried with the options this host allows (pinned memory and
    non-blocking copies only with CUDA, shared memory, synchronous staging); a stager that
    accepts is closed and not reused (its buffers would be warm)."""
    import torch
    from torch.distributed.checkpoint.staging import (
        BlockingAsyncStager,
        DefaultStager,
        StagingOptions,
    )

    cuda = torch.cuda.is_available()
    out: dict[str, str] = {}
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=True,
        use_async_staging=False,
        use_non_blocking_copy=cuda,
    )
    tries = {
        f"DefaultStager({options})": lambda: DefaultStager(options),
        "BlockingAsyncStager(cache_staged_state_dict=True)": lambda: BlockingAsyncStager(
            cache_staged_state_dict=True
        ),
    }
    for name, make in tries.items():
        stager = make()
        try:
            stager.stage(dict(state))
            out[name] = ""
        except Exception as e:  # noqa: BLE001 - what it refuses is the finding
            out[name] = refusal(e)
        finally:
            with contextlib.suppress(Exception):
                stager.close()
    return out


# -- torch_checkpointing ------------------------------------------------------------------------


def torch_checkpointing_available() -> str | None:
    """None when torch_checkpointing imports, else why not."""
    try:
        import torch_checkpointing
    except ImportError as e:
        return f"torch_checkpointing is not installed ({e}; requirements/common.txt)"
    version = getattr(torch_checkpointing, "__version__", "?")
    return None if str(version) == TORCH_CHECKPOINTING else f"torch_checkpointing {version}"


def torch_checkpointing_manager(*, barrier: tuple[str, int] | None = None) -> Any:
    """torch_checkpointing's ``CheckpointManager`` configured for this host.

    Args:
        barrier: ``(address, port)`` of a TCPStore for its commit barrier (rank 0's writer
            process serves it); None: its default barrier on the default process group's store
            (which must be a plain ``TCPStore`` or ``FileStore`` behind ``PrefixStore`` s).
    """
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.barriers import TCPStoreBarrierConfig
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cuda = torch.cuda.is_available()
    writer = CheckpointWriterConfig()
    if barrier is not None:
        writer = CheckpointWriterConfig(
            barrier_config=TCPStoreBarrierConfig(
                timeout_barrier_init_sec=600,
                use_checkpoint_barrier_tcpstore_libuv=True,
                tcpstore_port=barrier[1],
                master_address=barrier[0],
            )
        )
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(
            writer_config=writer,
            staging_config=CheckpointStagerConfig(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            ),
            # Its 30 s default is shorter than a spawned process's `import torch` on a busy
            # 2-core host.
            process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=600),
        ),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    return CheckpointManager(config)


def torch_checkpointing_loader() -> Any:
    """torch_checkpointing's ``CheckpointManager`` for loading only: a synchronous saver with no
    barrier, so no writer process is started (its reads are the same)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    writer = CheckpointWriterConfig(barrier_config=None, write_to_temp_dir=False)
    return CheckpointManager(
        CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(writer_config=writer),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _items(value: Any, fqn: str) -> Iterator[tuple[str, Any]]:
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        for i, shard in enumerate(value.local_shards()):
            yield f"{fqn}#{i}", shard.tensor
    elif isinstance(value, DTensor):
        yield fqn, value.to_local()
    elif isinstance(value, torch.Tensor):
        yield fqn, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _items(v, f"{fqn}.{k}" if fqn else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _items(v, f"{fqn}.{i}")


def local_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """Every tensor this rank holds in ``state`` (a state dict, nested), as plain tensors: a
    ``ShardedTensor``'s local shards (``<fqn>#<i>``), a ``DTensor``'s local part, plain tensors.
    Views of the live state: copying into them loads in place."""
    return dict(_items(state, ""))


def nbytes(tensors: Mapping[str, Any] | Any) -> int:
    """Bytes of a dict (or sequence) of tensors."""
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return int(sum(t.numel() * t.element_size() for t in values))
