"""Regions whose metrics go out through perfsdk's own exporters (set by the environment).

Run as ``python metrics_app.py RESULT_JSON``. It runs ``fwd`` five times, ``bwd`` three times and
``explode`` (raising ValueError) twice, writes each region's host_ms to the result, calls
``perfsdk.flush()`` and exits (perfsdk's exit shutdown exports once more). ``written_ns`` in the
result is ``time.monotonic_ns()`` when it was written, so a test can time the exit alone.

The metrics go through the MetricsSink that perfsdk's composition root (perfsdk.lifecycle)
registers in the pipeline.
"""

import json
import os
import sys
import time
from pathlib import Path

import perfsdk

host_ms: dict[str, list[float]] = {"fwd": [], "bwd": [], "explode": []}
for name, n in (("fwd", 5), ("bwd", 3)):
    for _ in range(n):
        with perfsdk.timed_region(name) as r:
            sum(range(20_000))
        host_ms[name].append(r.host_ms)
for _ in range(2):
    try:
        with perfsdk.timed_region("explode") as r:
            raise ValueError("boom")
    except ValueError:
        host_ms["explode"].append(r.host_ms)
perfsdk.flush()
Path(sys.argv[1]).write_text(json.dumps({"pid": os.getpid(), "host_ms": host_ms,
                                         "written_ns": time.monotonic_ns()}))
