"""An instrumented loop whose collector is down. Run as ``python unreachable_app.py RESULT_JSON``.

The result JSON is written before interpreter exit, so the test can compare the computed
values and, separately, time how long exit takes: ``written_ns`` is ``time.monotonic_ns()`` when
it was written (CLOCK_MONOTONIC, the same clock in every process).
"""

import json
import sys
import time

import torch

import perfsdk


@perfsdk.profiled("train_step", attributes={"phase": "train"})
def train_step(x: torch.Tensor, i: int) -> int:
    with perfsdk.timed_region("inner", step=i):
        return int((x * i).sum().item())


def main() -> None:
    x = torch.arange(16)
    values = [train_step(x, i) for i in range(200)]
    t0 = time.perf_counter()
    perfsdk.flush()
    flush_s = time.perf_counter() - t0
    more = [train_step(x, i) for i in range(200, 250)]  # regions after the failure still work
    with open(sys.argv[1], "w", encoding="utf-8") as fh:
        json.dump({"values": values + more, "flush_s": flush_s,
                   "diagnostics": perfsdk.diagnostics(), "written_ns": time.monotonic_ns()}, fh)


if __name__ == "__main__":
    main()
