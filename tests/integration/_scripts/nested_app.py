"""A small instrumented program: nested regions, a user OTel span, a failing region.

Run as ``python nested_app.py RESULT_JSON flush|exit|warm-exit``. With ``flush`` it calls
``perfsdk.flush()`` after its work; with ``exit`` it just returns, leaving the spans to
perfsdk's interpreter-exit shutdown; ``warm-exit`` first runs one region named ``warmup`` and
flushes (so perfsdk has set up its exporters before the work), then does the work and returns.
It writes a JSON result (pid, wall-clock window, computed values, the exception it caught).
Marker comments (``# LINE: name``) let the test find the source line of each declaration.
"""

import json
import os
import sys
import time

T_START = time.time_ns()

import torch  # noqa: E402
from opentelemetry import trace  # noqa: E402

import perfsdk  # noqa: E402

# Tracers are usually fetched at import time, before anything is exported.
tracer = trace.get_tracer("user.lib")


@perfsdk.profiled("leaf")  # LINE: leaf
def leaf(x: torch.Tensor, k: int) -> int:
    return int((x * k).sum().item())


BOOM = ValueError("boom 42")


@perfsdk.profiled("explode")  # LINE: explode
def explode() -> None:
    raise BOOM


@perfsdk.profiled(attributes={"user.kind": "train", "user.n": 3})  # LINE: root
def root(x: torch.Tensor) -> list[int]:
    out = []
    with perfsdk.timed_region("level2.a", batch=7, phase="warm"):  # LINE: level2.a
        with tracer.start_as_current_span("user.span") as span:
            span.set_attribute("user.attr", "yes")
            out.append(int(x.sum().item()))
        out.append(leaf(x, 2))
        out.append(leaf(x, 3))
    with perfsdk.timed_region("level2.b"):  # LINE: level2.b
        out.append(leaf(x, 4))
    return out


def main() -> None:
    result_path, how = sys.argv[1], sys.argv[2]
    if how == "warm-exit":
        with perfsdk.timed_region("warmup"):
            pass
        perfsdk.flush()
    x = torch.arange(16)
    values = root(x)
    caught: dict[str, object] = {}
    try:
        explode()
    except ValueError as exc:
        caught = {"type": type(exc).__name__, "message": str(exc), "same_object": exc is BOOM}
        print(f"caught: {exc!r}", file=sys.stderr)
    t_end = time.time_ns()
    if how == "flush":
        perfsdk.flush()
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "t_start": T_START, "t_end": t_end,
                   "values": values, "caught": caught, "file": os.path.abspath(__file__),
                   "torch": torch.__version__,
                   "diagnostics": perfsdk.diagnostics() if how == "flush" else None}, fh)


if __name__ == "__main__":
    main()
