"""Every initial value fastinit makes without a message, in one place."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

__all__ = ["materialize_dense", "seeded_generator_seed", "seeded_init"]


def seeded_generator_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the parameter (or module) ``name``; the same on every rank and process."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_init(items: list[tuple[torch.Tensor, Any, int]]) -> None:
    """Run ``init(tensor)`` for each ``(tensor, init, seed)`` with the RNG of the tensor's device
    seeded by ``seed``; the caller's RNG states (CPU and each CUDA device used) come back after.

    Only the generator of the tensor's own device is reseeded (``torch.manual_seed`` would reseed
    every CUDA device), and the states are saved once for the whole list.
    """
    if not items:
        return
    cuda = sorted({t.device.index or 0 for t, _, _ in items if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        for tensor, init, seed in items:
            if tensor.device.type == "cuda":
                with torch.cuda.device(tensor.device):
                    torch.cuda.manual_seed(seed)
            else:
                torch.random.default_generator.manual_seed(seed)
            init(tensor)


@torch.no_grad()
def materialize_dense(
    module: nn.Module, sharded: list[str], device: torch.device, seed: int
) -> None:
    """DMP's own ``init_parameters`` for the dense modules, with seeded per-module generators."""
    if "" in sharded:
        return
    prefixes = tuple(f"{p}." for p in sharded)
    for path, m in module.named_modules():
        if path in sharded or (prefixes and path.startswith(prefixes)):
            continue
        has_meta_param = False
        for name, param in m._parameters.items():
            if isinstance(param, torch.Tensor) and param.device.type == "meta":
                m._parameters[name] = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
                has_meta_param = True
        for name, buf in m._buffers.items():
            if isinstance(buf, torch.Tensor) and buf.device.type == "meta":
                m._buffers[name] = torch.zeros_like(buf, device=device)
        reset = getattr(m, "reset_parameters", None)
        if has_meta_param and reset is not None:
            anchor = torch.empty(0, device=device)
            seeded_init([(anchor, lambda _t, r=reset: r(), seeded_generator_seed(seed, path))])
