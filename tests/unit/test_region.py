"""The gate (RegionSpec.open): one enabled/sampled decision, one counter per spec, and the
shared null region for entries that record nothing."""

from __future__ import annotations

import math

import pytest

import perfsdk
from perfsdk.config import configure
from perfsdk.region import NULL_REGION, NullRegion, Region, RegionSpec
from perfsdk.testing import capture


def test_disabled_and_sampled_out_entries_get_the_one_shared_null_region():
    spec = RegionSpec.create("gate.null", every=2)
    first, second = spec.open(), spec.open()
    assert type(first) is Region
    assert first.recorded
    first.exit(None)
    assert second is NULL_REGION  # sampled out: nothing allocated
    second.exit(None)
    configure(enabled=False)
    assert spec.open() is NULL_REGION
    assert not NULL_REGION.recorded
    assert math.isnan(NULL_REGION.host_ms)
    NULL_REGION.set_attribute("k", 1)  # what shells call on an entry: all ignored
    with NULL_REGION as entry:
        assert entry is NULL_REGION


def test_disabled_entries_do_not_advance_the_counter():
    spec = RegionSpec.create("gate.count", every=2)
    configure(enabled=False)
    assert [spec.sampled() for _ in range(3)] == [False] * 3
    configure(enabled=True)
    assert [spec.sampled() for _ in range(4)] == [True, False, True, False]


def test_nvtx_only_push_pop_entries_share_one_object_per_spec():
    spec = RegionSpec.create("gate.nvtx")
    configure(timing=False)
    entry = spec.open()
    assert isinstance(entry, NullRegion)
    assert not entry.recorded
    entry.exit(None)
    if spec.nvtx.domain is not None:  # the nvtx package is installed
        assert entry is spec.nvtx_range
        again = spec.open()
        assert again is entry
        again.exit(None)
    configure(nvtx=False)
    assert spec.open() is NULL_REGION


def test_open_handle_always_gives_a_region_of_its_own():
    spec = RegionSpec.create("gate.handle", every=2)
    with capture() as cap:
        handles = [spec.open_handle({"i": i}) for i in range(2)]
        for handle in handles:
            if handle.entered:
                handle.exit(None)
    assert [h.recorded for h in handles] == [True, False]
    assert handles[1].attributes["i"] == 1
    assert not handles[1].result().recorded
    assert [r.attributes["i"] for r in cap.named("gate.handle")] == [0]


def test_every_counts_per_function_and_sample_every_per_block():
    @perfsdk.profiled("gate.f", every=3)
    def f() -> None:
        pass

    @perfsdk.profiled("gate.g", every=3)
    def g() -> None:
        pass

    configure(sample_every=2)
    with capture() as cap:
        for _ in range(6):
            f()
            g()
            with perfsdk.timed_region("gate.a"):
                pass
            with perfsdk.timed_region("gate.b"):
                pass
    counts = {name: len(cap.named(name)) for name in ("gate.f", "gate.g", "gate.a", "gate.b")}
    assert counts == {"gate.f": 2, "gate.g": 2, "gate.a": 3, "gate.b": 3}


def test_every_is_validated_on_the_spec():
    with pytest.raises(ValueError, match=r"every=0; accepted values are None or an integer"):
        RegionSpec.create("gate.bad", every=0, where="gate")
