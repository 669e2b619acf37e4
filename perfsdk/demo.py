"""The demo behind ``perfsdk demo``, under the import path the README gave it before it moved
into the command's package: it lives in :mod:`perfsdk.cli.demo`."""

from __future__ import annotations

from perfsdk.cli.demo import (
    BUDGET_S,
    KEEP_ABOVE,
    LATENCY_MS,
    DemoResult,
    Phase,
    Setup,
    StoredImages,
    Trial,
    measure_fix,
    run_demo,
)

__all__ = ["BUDGET_S", "KEEP_ABOVE", "LATENCY_MS", "DemoResult", "Phase", "Setup",
           "StoredImages", "Trial", "measure_fix", "run_demo"]
