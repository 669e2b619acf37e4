"""perfsdk.instrumentor: the integration contract with a fake entry point, and instrument_all
with the real integrations (Lightning and transformers are installed in the dev environment)."""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Collection, Iterator
from typing import Any

import pytest

import perfsdk
from perfsdk import instrumentor as inst


class Fake(inst.Instrumentor):
    calls: list[tuple[str, dict[str, Any]]] = []  # noqa: RUF012
    requirements: tuple[str, ...] = ("torch >= 2.2",)

    def instrumentation_dependencies(self) -> Collection[str]:
        return self.requirements

    def _instrument(self, **kwargs: Any) -> None:
        Fake.calls.append(("instrument", kwargs))

    def _uninstrument(self, **kwargs: Any) -> None:
        Fake.calls.append(("uninstrument", kwargs))


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    Fake.calls.clear()
    Fake.requirements = ("torch >= 2.2",)
    yield
    if Fake().is_instrumented:
        Fake().uninstrument()


def test_singleton_and_idempotent() -> None:
    assert Fake() is Fake()
    assert Fake().instrument(report=False) is True
    assert Fake().instrument() is False  # logged, nothing done
    assert Fake().uninstrument() is True
    assert Fake().uninstrument() is False
    assert Fake.calls == [("instrument", {"report": False}), ("uninstrument", {})]


@pytest.mark.parametrize("requirement", ["no-such-distribution >= 1", "torch >= 999"])
def test_missing_or_too_old_framework_is_skipped(requirement: str) -> None:
    Fake.requirements = (requirement,)
    with pytest.warns(perfsdk.PerfSDKWarning, match="not instrumented"):
        assert Fake().instrument() is False
    assert not Fake().is_instrumented
    assert Fake.calls == []
    with pytest.raises(ImportError, match="is required"):
        Fake().instrument(raise_on_missing=True)
    assert Fake().instrument(skip_dep_check=True) is True


def test_check_dependencies_without_packaging() -> None:
    assert inst._simple_contains(">= 2.2, < 3", "2.13.0+cpu")
    assert not inst._simple_contains(">= 2.2", "2.1.9")
    assert str(inst.check_dependencies(["torch >= 999"])).startswith("'torch >= 999' is required")


class _EntryPoint:
    def __init__(self, name: str, loaded: Any, requires: list[str]) -> None:
        self.name = name
        self._loaded = loaded
        self.dist = type("Dist", (), {"requires": requires})()

    def load(self) -> Any:
        return self._loaded


def test_instrument_all_reads_the_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no")

    points = [
        _EntryPoint("fake", Fake, ['torch>=2.2; extra == "instruments"', "perfsdk"]),
        _EntryPoint("fake", Fake, []),  # found twice on sys.path: once
        _EntryPoint("absent", Fake, ['no-such-distribution>=1; extra == "instruments"']),
        _EntryPoint("broken", broken, []),
    ]

    def entry_points(*, group: str) -> list[_EntryPoint]:
        assert group == inst.ENTRY_POINT_GROUP
        return points

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    with pytest.warns(perfsdk.PerfSDKWarning, match="'broken' could not be instrumented"):
        results = perfsdk.instrument_all(report=False)
    assert [(r.name, r.instrumented) for r in results] == [
        ("fake", True), ("absent", False), ("broken", False)]
    assert "not installed" in results[1].reason
    assert results[0].instrumentor is Fake()
    assert Fake.calls == [("instrument", {"report": False})]
    again = perfsdk.instrument_all(report=False)
    assert again[0].reason == "already instrumented"


def test_instrument_all_with_the_real_integrations() -> None:
    pytest.importorskip("perfsdk_lightning")
    pytest.importorskip("perfsdk_transformers")
    results = {r.name: r for r in perfsdk.instrument_all(report=False)}
    try:
        for name in ("lightning", "transformers"):
            if name in results:  # installed (editable) in the dev environment
                assert results[name].instrumented, results[name].reason
    finally:
        for result in results.values():
            if result.instrumented and result.instrumentor is not None:
                result.instrumentor.uninstrument()


def test_the_base_installs_and_removes_the_patches_of_a_subclass() -> None:
    """A subclass that states its requirements and its InitPatches alone."""
    import argparse

    made: list[str] = []

    class Patching(inst.Instrumentor):
        instruments = ("torch >= 2.2",)
        distribution = "perfsdk-patching"

        def _patches(self, **kwargs: Any) -> list[inst.InitPatch]:
            if kwargs.get("report") not in (None, True, False):
                raise ValueError("report")
            return [inst.InitPatch("argparse", "ArgumentParser",
                                   lambda parser: made.append(parser.prog))]

    original = argparse.ArgumentParser.__dict__["__init__"]
    assert Patching().instrumentation_dependencies() == ("torch >= 2.2",)
    with pytest.raises(ValueError, match="report"):
        Patching().instrument(report="yes")
    assert not Patching().is_instrumented
    assert Patching().instrument(report=False) is True
    argparse.ArgumentParser(prog="one")
    assert Patching().uninstrument() is True
    argparse.ArgumentParser(prog="two")
    assert made == ["one"]
    assert argparse.ArgumentParser.__dict__["__init__"] is original
    Patching.instruments = ("no-such-distribution >= 1",)
    with pytest.raises(ImportError, match="pip install 'perfsdk-patching"):
        Patching().instrument(raise_on_missing=True)


def test_the_base_itself_is_not_an_instrumentor() -> None:
    with pytest.raises(TypeError, match="subclass it"):
        inst.Instrumentor()


class _Owner:
    pass


class _Slotted:
    __slots__ = ()  # no weak reference to it


def test_framework_steps_by_owner() -> None:
    steps = inst.FrameworkSteps()
    first, second, slotted = _Owner(), _Owner(), _Slotted()
    assert not steps.active
    steps.begin(first)
    steps.begin(first)  # each owner counts once
    steps.begin(second)
    steps.end(first)
    assert steps.active  # the second still draws the steps
    steps.end(second)
    steps.end(second)  # idempotent
    assert not steps.active
    steps.begin(slotted)
    assert steps.active
    steps.end(slotted)
    assert not steps.active
    steps.end(_Owner())  # never began: nothing
    assert not steps.active


def test_framework_steps_end_with_a_collected_owner() -> None:
    """A run that raised before its end hook, and its trainer (the callback) dropped."""
    import gc

    steps = inst.FrameworkSteps()
    owner = _Owner()
    steps.begin(owner)
    del owner
    gc.collect()
    assert not steps.active
    assert inst.FRAMEWORK_STEPS.active is False  # the process-wide one, outside any run
