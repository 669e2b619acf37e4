"""perfsdk's own aggregation of its per-region histograms, added to each export of the metric
exporters perfsdk made itself.

Recording one value into an OpenTelemetry SDK histogram costs about 6 us on the pipeline thread
(a measurement object, attribute cleaning and hashing, the exemplar filter, a lock), once or
twice a region, and that thread shares the GIL with the training thread. So when perfsdk owns
the MeterProvider and every reader on it is one perfsdk made around an exporter (``otlp``,
``console``, ``file`` or a ``MetricExporter`` instance; see :mod:`perfsdk.export.metrics`), the
histograms ``perfsdk.region.duration`` and ``perfsdk.region.device_duration`` are aggregated
here instead (about 0.5 us a value, one lock a batch of records), and
:meth:`Histograms.inject` adds their points to each export as the SDK would have made them:

* explicit buckets with the instrument's bounds, a value on a bound counted in the bucket it
  closes (``bisect_left``, as the SDK), count, sum, min and max;
* the exporter's temporality for histograms: cumulative points start at the first value the
  exporter saw for that stream and carry everything since; delta points cover the time since
  the exporter's last export, and a stream with no new value has no point;
* no exemplars (on perfsdk's thread the SDK's default trace-based filter keeps none either).

A point's ``time_unix_nano`` is the export's collection time (the time of the other perfsdk
points in the same export). Values recorded after the SDK collected the other instruments and
before the exporter ran are in this export's histograms (the SDK would put them in the next).
An export that the SDK does not make (no other metric at all) leaves the values for the next.
"""

from __future__ import annotations

import dataclasses
import threading
from bisect import bisect_left
from collections.abc import Sequence
from time import time_ns
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from perfsdk._version import __version__

__all__ = ["Histograms", "Stream", "View"]

_SCOPE = InstrumentationScope("perfsdk", __version__)
_CUMULATIVE = AggregationTemporality.CUMULATIVE


class Stream:
    """One histogram stream (a metric and one set of attributes): its values so far."""

    __slots__ = ("attributes", "bounds", "counts", "max", "metric", "min", "start", "sum")

    def __init__(self, metric: str, attributes: dict[str, Any], bounds: Sequence[float],
                 start: int) -> None:
        self.metric, self.attributes, self.bounds, self.start = metric, attributes, bounds, start
        self.counts = [0] * (len(bounds) + 1)
        self.sum: float = 0
        self.min = float("inf")
        self.max = float("-inf")

    def add(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value

    def merge(self, other: Stream) -> None:
        counts = self.counts
        for i, n in enumerate(other.counts):
            counts[i] += n
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.start = min(self.start, other.start)

    def copy(self) -> Stream:
        out = Stream(self.metric, self.attributes, self.bounds, self.start)
        out.merge(self)
        return out

    def point(self, start: int, now: int) -> HistogramDataPoint:
        return HistogramDataPoint(
            attributes=self.attributes, start_time_unix_nano=start, time_unix_nano=now,
            count=sum(self.counts), sum=self.sum, bucket_counts=tuple(self.counts),
            explicit_bounds=tuple(self.bounds), min=self.min, max=self.max, exemplars=[])


class View:
    """One exporter's view of the histograms: everything since it was made (cumulative) or
    since its last export (delta)."""

    def __init__(self, temporality: AggregationTemporality, resource: Resource) -> None:
        self.temporality = temporality
        self.resource = resource
        self.streams: dict[Any, Stream] = {}
        self.known: set[Any] = set()
        """Delta: streams exported before (their next point starts at the last export)."""
        self.last = time_ns()

    def take(self, pending: dict[Any, Stream]) -> None:
        streams = self.streams
        for key, stream in pending.items():
            mine = streams.get(key)
            if mine is None:
                streams[key] = stream.copy()
            else:
                mine.merge(stream)

    def points(self, now: int) -> dict[str, list[HistogramDataPoint]]:
        out: dict[str, list[HistogramDataPoint]] = {}
        if self.temporality is _CUMULATIVE:
            for stream in self.streams.values():
                out.setdefault(stream.metric, []).append(stream.point(stream.start, now))
        else:  # as the SDK: a stream's first point starts at its first value
            known, last = self.known, self.last
            for key, stream in self.streams.items():
                out.setdefault(stream.metric, []).append(
                    stream.point(last if key in known else stream.start, now))
                known.add(key)
            self.streams = {}
        self.last = now
        return out


class Histograms:
    """The values recorded since the last export (``pending``, under ``lock``), the exporters'
    views, and what each histogram is (name -> description, unit)."""

    def __init__(self, described: dict[str, tuple[str, str]]) -> None:
        self.described = described
        self.lock = threading.Lock()
        self.pending: dict[Any, Stream] = {}
        """(metric, key) -> values since the views last took them; the recorder adds here."""
        self.views: list[View] = []

    def view(self, temporality: AggregationTemporality, resource: Resource) -> View:
        """A new exporter's view: it sees the values recorded from now on."""
        view = View(temporality, resource)
        with self.lock:
            self._hand_out()
            self.views.append(view)
        return view

    def forget(self, view: View) -> None:
        with self.lock:
            self._hand_out()
            if view in self.views:
                self.views.remove(view)

    def reset(self) -> None:
        """In a forked child: the parent's values and views are the parent's."""
        self.lock = threading.Lock()
        self.pending = {}
        self.views = []

    def _hand_out(self) -> None:
        pending = self.pending
        if pending:
            for view in self.views:
                view.take(pending)
            self.pending = {}

    def inject(self, view: View, data: MetricsData | None) -> MetricsData | None:
        """``data`` (one collection of the SDK) with this view's histogram points added to its
        ``perfsdk`` scope."""
        with self.lock:
            self._hand_out()
            now = _collection_time(data) or time_ns()
            points = view.points(now)
        if not points:
            return data
        temporality = view.temporality
        ours = [Metric(name=name, description=self.described[name][0],
                       unit=self.described[name][1],
                       data=Histogram(data_points=points[name],
                                      aggregation_temporality=temporality))
                for name in self.described if points.get(name)]
        if data is None or not data.resource_metrics:
            return MetricsData(resource_metrics=[ResourceMetrics(
                resource=view.resource, scope_metrics=[ScopeMetrics(_SCOPE, ours, "")],
                schema_url=view.resource.schema_url)])
        first, *rest = data.resource_metrics
        scopes = list(first.scope_metrics)
        for i, scope in enumerate(scopes):
            if scope.scope.name == "perfsdk":
                scopes[i] = dataclasses.replace(scope, metrics=[*ours, *scope.metrics])
                break
        else:
            scopes.append(ScopeMetrics(_SCOPE, ours, ""))
        return dataclasses.replace(data, resource_metrics=[
            dataclasses.replace(first, scope_metrics=scopes), *rest])


def _collection_time(data: MetricsData | None) -> int | None:
    """The SDK's collection time in ``data``: the time of a point in perfsdk's scope."""
    for resource_metrics in data.resource_metrics if data is not None else ():
        for scope in resource_metrics.scope_metrics:
            if scope.scope.name == "perfsdk":
                for metric in scope.metrics:
                    for point in getattr(metric.data, "data_points", ()):
                        return int(point.time_unix_nano)
    return None
