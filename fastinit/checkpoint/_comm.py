"""The checkpoint's few small collectives, each bounded by ``FASTINIT_COLLECTIVE_TIMEOUT``.

A save sends one all_gather of a 64-byte record when it starts (every rank agrees on the
save's identity and directory before a byte is written) and, in ``wait()``, one all_gather of
a 24-byte record plus a one-byte broadcast (the verdict); a load sends one all_reduce of one
int64 (the verdict). Messages travel on the device the group's backend serves (CPU on gloo and
on a ``cpu:gloo,cuda:nccl`` group, CUDA on NCCL). Without a process group (or a world of one)
nothing is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from fastinit import knobs
from fastinit.errors import FastinitError

__all__ = ["Group", "CollectiveFailed"]


class CollectiveFailed(FastinitError, RuntimeError):
    """A checkpoint collective failed or timed out: a peer died, hung or took another path."""


class Group:
    """The default process group as the checkpoint uses it (or none: a world of one)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.pg: Any = None
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.pg = dist.group.WORLD
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = knobs.get_collective_timeout()
        self.sent = 0

    @property
    def distributed(self) -> bool:
        return self.pg is not None and self.world_size > 1

    def _device(self) -> Any:
        import torch
        import torch.distributed as dist

        types = {d.type for d in getattr(self.pg, "_device_types", ())}
        if not types:
            types = {"cuda"} if dist.get_backend(self.pg) == "nccl" else {"cpu"}
        if "cpu" in types or "cuda" not in types:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - any failure of the collective is a peer's
            raise CollectiveFailed(
                f"the checkpoint's {what} failed on rank {self.rank}: a peer died, hung or did "
                f"not take the same path (FASTINIT_COLLECTIVE_TIMEOUT={self.timeout:g}s): {e}"
            ) from e

    def all_gather_bytes(self, data: bytes, size: int, what: str) -> list[bytes]:
        """Every rank's ``data`` (padded to ``size`` bytes)."""
        if not self.distributed:
            return [data.ljust(size, b"\0")]
        import torch
        import torch.distributed as dist

        device = self._device()
        mine = torch.frombuffer(bytearray(data.ljust(size, b"\0")), dtype=torch.uint8).to(device)
        flat = torch.empty((self.world_size, size), dtype=torch.uint8, device=device)
        work = dist.all_gather(list(flat.unbind(0)), mine, group=self.pg, async_op=True)
        self.sent += 1
        self._wait(work, what)
        raw = flat.cpu().numpy().tobytes()
        return [raw[r * size : (r + 1) * size] for r in range(self.world_size)]

    def broadcast_byte(self, value: int, what: str) -> int:
        """Rank 0's ``value`` (0..255) on every rank."""
        if not self.distributed:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.uint8, device=self._device())
        work = dist.broadcast(t, src=dist.get_global_rank(self.pg, 0), group=self.pg, async_op=True)
        self.sent += 1
        self._wait(work, what)
        return int(t.item())

    def all_reduce_min(self, value: int, what: str) -> int:
        """The minimum of ``value`` (an int64) over the ranks."""
        return self.all_reduce_mins([value], what)[0]

    def all_reduce_mins(self, values: Sequence[int], what: str) -> list[int]:
        """The minimum of each of ``values`` (int64s) over the ranks, in one all_reduce."""
        if not self.distributed:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.int64, device=self._device())
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg, async_op=True)
        self.sent += 1
        self._wait(work, what)
        return [int(v) for v in t.tolist()]
