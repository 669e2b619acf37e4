"""The autocast probe: measured once per process, a positive ratio, bad dtypes named."""

from __future__ import annotations

import pytest
import torch

from perfsdk.optimize import probe


def test_probe_is_measured_once_and_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    probe.autocast_speedup.cache_clear()
    calls = []
    real = probe._time
    monkeypatch.setattr(probe, "_time", lambda fn, sync: calls.append(1) or real(fn, sync))
    first = probe.autocast_speedup(torch.bfloat16)
    again = probe.autocast_speedup(torch.bfloat16)
    assert first == again > 0
    assert len(calls) == 2 * probe._ROUNDS  # the second call is served from the cache


def test_pays_follows_the_measured_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "autocast_speedup", lambda dtype, device="cpu": 0.1)
    assert not probe.autocast_pays(torch.bfloat16)
    monkeypatch.setattr(probe, "autocast_speedup", lambda dtype, device="cpu": 1.3)
    assert probe.autocast_pays(torch.bfloat16)


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch\.float32.*torch\.bfloat16"):
        probe.autocast_speedup(torch.float32)
