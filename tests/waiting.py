"""Polling for background work (the pipeline thread, the GPU sampler) in tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], object], timeout: float = 60.0,
               poll: float = 0.001) -> bool:
    """Poll ``condition`` until it is true (True) or ``timeout`` seconds pass (False). The
    timeout only ends a hang: a busy machine may take long, and a passing test never waits it
    out, so it is generous."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def one_pipeline_round(timeout: float = 60.0) -> None:
    """Wake perfsdk's pipeline thread and return once the round that started has ended (its
    hooks and its drain), however long a busy machine makes that take."""
    from perfsdk.pipeline import PIPELINE

    done = threading.Event()
    drain = PIPELINE.drain

    def drain_and_tell(wait: bool, timeout: float = -1, **kwargs: Any) -> int:
        try:
            return drain(wait, timeout, **kwargs)
        finally:
            if threading.current_thread().name == "perfsdk-pipeline":
                done.set()

    PIPELINE.drain = drain_and_tell  # type: ignore[method-assign]
    try:
        PIPELINE.start()
        PIPELINE.wake()
        assert done.wait(timeout), "the pipeline thread did not run a round"
    finally:
        del PIPELINE.drain  # the class's method again
