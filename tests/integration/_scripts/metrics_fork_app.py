"""perfsdk's file metrics across ``os.fork``: each process writes its own regions, once.

Run as ``python metrics_fork_app.py RESULT_JSON`` with PERFSDK_EXPORTER=file. The parent runs
``parent`` three times and flushes, forks a child that runs ``child`` twice, flushes and leaves
with ``os._exit`` after perfsdk's shutdown (as a multiprocessing worker does), then runs
``parent`` once more and exits normally.
"""

import json
import os
import sys
from pathlib import Path

import perfsdk

for _ in range(3):
    with perfsdk.timed_region("parent"):
        pass
perfsdk.flush()
child = os.fork()
if child == 0:
    code = 1
    try:
        for _ in range(2):
            with perfsdk.timed_region("child"):
                pass
        perfsdk.flush()
        perfsdk.shutdown()
        code = 0
    finally:
        os._exit(code)
_, status = os.waitpid(child, 0)
with perfsdk.timed_region("parent"):
    pass
perfsdk.flush()
Path(sys.argv[1]).write_text(json.dumps({"parent": os.getpid(), "child": child,
                                         "child_status": status}))
