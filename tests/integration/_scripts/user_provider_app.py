"""An application that installs its own OpenTelemetry TracerProvider before using perfsdk.

Run as ``python user_provider_app.py RESULT_JSON ENDPOINT grpc|http``.
"""

import json
import os
import sys

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

result_path, endpoint, protocol = sys.argv[1], sys.argv[2], sys.argv[3]
if protocol == "grpc":
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=5)
else:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
        OTLPSpanExporter,
    )

    exporter = OTLPSpanExporter(endpoint=endpoint + "/v1/traces", timeout=5)

provider = TracerProvider(resource=Resource.create({"service.name": "user-app"}))
provider.add_span_processor(BatchSpanProcessor(exporter))
trace.set_tracer_provider(provider)

import perfsdk  # noqa: E402

tracer = trace.get_tracer("user.lib")


@perfsdk.profiled("step")
def step(i: int) -> int:
    with tracer.start_as_current_span(f"user.in-step-{i}"):
        return i * i


def main() -> None:
    with perfsdk.timed_region("outer", epoch=1):
        values = [step(i) for i in range(2)]
        with tracer.start_as_current_span("user.in-outer"):
            pass
    with tracer.start_as_current_span("user.top"), perfsdk.timed_region("under-user"):
        pass
    perfsdk.flush()
    processors = provider._active_span_processor._span_processors  # what perfsdk left in place
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "values": values,
                   "processors": [type(p).__name__ for p in processors],
                   "global_is_ours": trace.get_tracer_provider() is provider,
                   "diagnostics": perfsdk.diagnostics()}, fh)


if __name__ == "__main__":
    main()
