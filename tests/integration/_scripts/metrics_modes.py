"""perfsdk's metrics and the global MeterProvider, in a fresh interpreter.

Run as ``python metrics_modes.py RESULT_JSON owned|user|off``:

* ``owned``: PERFSDK_EXPORTER=file (set by the test); the app fetched a meter before perfsdk
  did anything. perfsdk must install its provider globally, so the app's meters share it.
* ``user``: the app installs its own MeterProvider first; perfsdk must record into it and add no
  reader (PERFSDK_EXPORTER=console is set and must be ignored for metrics).
* ``off``: no exporter: nothing is made and the global provider stays the proxy.

The script uses the MetricsSink already in perfsdk's pipeline, or adds one if perfsdk does not
register one itself yet.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

result_path, scenario = sys.argv[1], sys.argv[2]
app_reader = InMemoryMetricReader()
app_provider = MeterProvider(metric_readers=[app_reader],
                             resource=Resource.create({"service.name": "user-app"}))
if scenario == "user":
    metrics.set_meter_provider(app_provider)
early = metrics.get_meter("app").create_counter("app.early")
early.add(5)  # before perfsdk installed anything: the proxy drops it in the owned scenario

import perfsdk  # noqa: E402
import perfsdk.lifecycle  # noqa: E402  (the composition root registers the metrics sink)
from perfsdk.config import get_config  # noqa: E402
from perfsdk.export.metrics import MetricsSink  # noqa: E402
from perfsdk.pipeline import PIPELINE  # noqa: E402

sink = next(s for s in PIPELINE.sinks if isinstance(s, MetricsSink))

out: dict[str, Any] = {"before": {"mode": sink._mode or "undecided",
                                  "global": type(metrics.get_meter_provider()).__name__}}
for i in range(4):
    with perfsdk.timed_region("train", step=i):
        sum(range(1000))
out["mode"] = sink.mode
early.add(2)
metrics.get_meter("app").create_counter("app.late").add(1)
perfsdk.flush()


def from_json(data: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """(region -> duration count, app counter -> value) from MetricsData JSON."""
    regions: dict[str, int] = {}
    app: dict[str, int] = {}
    for rm in data["resource_metrics"]:
        for sm in rm["scope_metrics"]:
            for m in sm["metrics"]:
                for p in m["data"]["data_points"]:
                    if m["name"] == "perfsdk.region.duration":
                        regions[p["attributes"]["perfsdk.region"]] = p["count"]
                    elif m["name"].startswith("app."):
                        app[m["name"]] = p["value"]
    return regions, app


if scenario == "owned":
    out["global_is_perfsdk"] = metrics.get_meter_provider() is sink._provider
    lines = (Path(get_config().output_dir) / f"metrics-{os.getpid()}.jsonl").read_text()
    out["region_counts"], out["app_counters"] = from_json(json.loads(lines.splitlines()[-1]))
elif scenario == "user":
    provider = metrics.get_meter_provider()
    out["readers_on_app_provider"] = len(app_provider._measurement_consumer._reader_storages)
    out["global_is_app"] = provider is app_provider
    out["readers_added"] = len(sink.exporters) + len(sink._built) + len(sink._given)
    data = app_reader.get_metrics_data()
    assert data is not None
    out["region_counts"], out["app_counters"] = from_json(json.loads(data.to_json()))
else:
    out["provider_made"] = sink._provider is not None
    out["global"] = type(metrics.get_meter_provider()).__name__
Path(result_path).write_text(json.dumps(out))
