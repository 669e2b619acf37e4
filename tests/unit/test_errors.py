"""errors: warn once, count every time, never raise; the exception types."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest

import perfsdk
from perfsdk import errors
from perfsdk.errors import (
    MissingDependencyError,
    NoEffectWarning,
    PerfSDKError,
    PerfSDKWarning,
    warn_once,
)


def test_warns_on_first_occurrence_only_and_counts_all():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(5):
            warn_once("test:kind-a", "perfsdk: kind a went wrong")
        warn_once("test:kind-b", "perfsdk: kind b went wrong")
    assert [str(w.message) for w in seen] == ["perfsdk: kind a went wrong",
                                              "perfsdk: kind b went wrong"]
    assert all(w.category is PerfSDKWarning for w in seen)
    assert errors.counts()["test:kind-a"] == 5
    assert errors.counts()["test:kind-b"] == 1
    assert perfsdk.diagnostics()["warnings"]["test:kind-a"] == 5


def test_warning_points_at_the_caller_of_the_reporting_function():
    def report():
        warn_once("test:where", "perfsdk: where")

    with pytest.warns(PerfSDKWarning) as record:
        report()  # stacklevel: warn_once -> report -> here
    assert record[0].filename == __file__


def test_custom_category():
    with pytest.warns(NoEffectWarning, match="nothing to do"):
        warn_once("test:noeffect", "nothing to do", NoEffectWarning)


def test_never_raises_when_warnings_are_errors(caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="perfsdk"):
            warn_once("test:strict", "perfsdk: strict filters")
    assert [r.getMessage() for r in caplog.records] == ["perfsdk: strict filters"]
    assert caplog.records[0].name == "perfsdk"
    assert errors.counts()["test:strict"] == 1


def test_reset_counts_rearms_the_warning():
    with pytest.warns(PerfSDKWarning):
        warn_once("test:rearm", "perfsdk: again")
    errors.reset_counts()
    assert "test:rearm" not in errors.counts()
    with pytest.warns(PerfSDKWarning):
        warn_once("test:rearm", "perfsdk: again")


def test_thread_safe_counting():
    barrier = threading.Barrier(8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")

        def hammer():
            barrier.wait()
            for _ in range(200):
                warn_once("test:threads", "perfsdk: from threads")

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors.counts()["test:threads"] == 1600
    assert len([w for w in seen if "from threads" in str(w.message)]) == 1


def test_exception_types():
    err = MissingDependencyError("pynvml", "nvml", "GPU readings")
    assert isinstance(err, ImportError)  # `except ImportError` keeps working
    assert isinstance(err, PerfSDKError)
    assert "GPU readings needs the 'pynvml' package" in str(err)
    assert "pip install 'perfsdk[nvml]'" in str(err)
    assert (err.package, err.extra) == ("pynvml", "nvml")
    assert issubclass(NoEffectWarning, PerfSDKWarning)
    assert issubclass(PerfSDKWarning, UserWarning)
    for name in ("PerfSDKError", "MissingDependencyError", "PerfSDKWarning", "NoEffectWarning"):
        assert getattr(perfsdk, name) is getattr(errors, name)
