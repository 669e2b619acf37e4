"""The old import path of :mod:`perfsdk.export.runfile` (the run ``perfsdk run`` and ``perfsdk
demo`` save, and ``perfsdk report`` and ``perfsdk compare`` read). It moved below the
capabilities so that :func:`perfsdk.bench.compare_runs` can read saved runs."""

from perfsdk.export.runfile import (
    FORMAT,
    MAX_REGIONS,
    REDACTED,
    RUN_FILE,
    SECRET_PAIRS,
    SECRET_WORDS,
    RunRecorder,
    SavedRun,
    is_secret_name,
    load_run,
    redact_command,
    save_run,
)

__all__ = ["FORMAT", "MAX_REGIONS", "REDACTED", "RUN_FILE", "SECRET_PAIRS", "SECRET_WORDS",
           "RunRecorder", "SavedRun", "is_secret_name", "load_run", "redact_command",
           "save_run"]
