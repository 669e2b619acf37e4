"""Which process of a multi-process (``torchrun``, DDP) job this is, for every region.

:func:`rank_attributes` gives ``perfsdk.rank``, ``perfsdk.local_rank`` and
``perfsdk.world_size``: from ``torch.distributed`` once the application has initialized its
process group, else from the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``); nothing for a single process. Every region's span, its ``RegionResult`` and its
trace-file slice carry them, so Jaeger, Tempo and the summary tell the ranks apart. They are read
on perfsdk's pipeline thread when records are exported, never on the training thread, and never
with a collective.

Example:
    >>> rank_attributes({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    {'perfsdk.rank': 1, 'perfsdk.local_rank': 1, 'perfsdk.world_size': 2}
    >>> rank_attributes({})
    {}
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["RANK_ATTRIBUTES", "rank_attributes"]

RANK_ATTRIBUTES = ("perfsdk.rank", "perfsdk.local_rank", "perfsdk.world_size")
"""The attribute names, in order."""

_from_group: dict[str, int] | None = None  # fixed once the process group exists
_from_env: dict[str, int] | None = None  # torchrun's variables, read once


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _read_env(env: Mapping[str, str]) -> dict[str, int]:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None or world is None:
        return {}
    out = {"perfsdk.rank": rank, "perfsdk.local_rank": _int(env, "LOCAL_RANK"),
           "perfsdk.world_size": world}
    return {k: v for k, v in out.items() if v is not None}


def rank_attributes(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """This process's rank, local rank and world size as span attributes; ``{}`` when it is not
    part of a multi-process job. ``env`` (for tests) replaces ``os.environ`` and the process
    group."""
    global _from_group, _from_env
    if env is not None:
        return _read_env(env)
    if _from_group is not None:
        return dict(_from_group)
    if _from_env is None:
        _from_env = _read_env(os.environ)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        found = {"perfsdk.rank": dist.get_rank(), "perfsdk.world_size": dist.get_world_size()}
        if "perfsdk.local_rank" in _from_env:
            found["perfsdk.local_rank"] = _from_env["perfsdk.local_rank"]
        _from_group = {k: found[k] for k in RANK_ATTRIBUTES if k in found}
        return dict(_from_group)
    return dict(_from_env)


