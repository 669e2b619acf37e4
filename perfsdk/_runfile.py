"""A run as the ``perfsdk`` command keeps it: every region recorded while it ran (a pipeline
sink), and ``run.json`` in the output directory, from which ``perfsdk report DIR`` renders the
summary and the advice again.

``run.json`` holds what the command was, its exit code and wall time, the paths of the files
written beside it (trace, spans), the summary rows, and the regions themselves (name, times,
attributes, error type and message), so the advice can be derived again from the data rather
than copied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from perfsdk.errors import warn_once
from perfsdk.export.summary import RegionStats, Summary
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult, to_result

__all__ = ["RUN_FILE", "RunRecorder", "SavedRun", "load_run", "save_run"]

RUN_FILE = "run.json"
FORMAT = 1
MAX_REGIONS = 200_000
"""Regions a :class:`RunRecorder` keeps; later ones are counted in ``dropped``, not kept."""


class RunRecorder:
    """A pipeline sink keeping every resolved region as a :class:`RegionResult` (bounded)."""

    def __init__(self, limit: int = MAX_REGIONS) -> None:
        self.limit = limit
        self.regions: list[RegionResult] = []
        self.dropped = 0
        self._lock = threading.Lock()

    def consume(self, records: list[Any]) -> None:
        with self._lock:
            room = self.limit - len(self.regions)
            self.regions.extend(to_result(r) for r in records[:max(room, 0)])
            if len(records) > room:
                self.dropped += len(records) - max(room, 0)
                warn_once("run-recorder-full",
                          f"perfsdk: the run keeps the first {self.limit} regions for its "
                          "report; later ones are counted in the summary but not kept")

    def flush(self, timeout: float) -> None:
        pass

    def shutdown(self, timeout: float) -> None:
        pass

    def __enter__(self) -> RunRecorder:
        PIPELINE.sinks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        PIPELINE.drain(wait=True)
        if self in PIPELINE.sinks:
            PIPELINE.sinks.remove(self)


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """What ``run.json`` holds."""

    command: tuple[str, ...]
    exit_code: int
    wall_s: float
    files: Mapping[str, str]
    summary: Summary
    regions: tuple[RegionResult, ...]
    dropped: int


class _SavedError(Exception):
    """An exception of the run, as saved (its type's name and message)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __repr__(self) -> str:
        return f"{self.kind}({str(self)!r})"


def _region_dict(region: RegionResult) -> dict[str, Any]:
    data = dataclasses.asdict(dataclasses.replace(region, attributes={}, memory=None,
                                                  error=None))
    data["attributes"] = dict(region.attributes)
    data["memory"] = None if region.memory is None else dict(region.memory)
    error = region.error
    data["error"] = None if error is None else {
        "type": getattr(error, "kind", type(error).__name__), "message": str(error)}
    return data


def _region(data: Mapping[str, Any]) -> RegionResult:
    fields = dict(data)
    error = fields.pop("error")
    memory = fields.pop("memory")
    attributes = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in fields.pop("attributes").items()}
    return RegionResult(**fields, attributes=MappingProxyType(attributes),
                        error=None if error is None else _SavedError(error["type"],
                                                                     error["message"]),
                        memory=None if memory is None else MappingProxyType(memory))


def save_run(directory: str | os.PathLike[str], *, command: Sequence[str], exit_code: int,
             wall_s: float, files: Mapping[str, str], summary: Summary,
             regions: Sequence[RegionResult], dropped: int = 0) -> Path:
    """Write ``run.json`` in ``directory`` (atomically) and return its path."""
    path = Path(directory) / RUN_FILE
    data = {"format": FORMAT, "command": list(command), "exit_code": exit_code,
            "wall_s": wall_s, "files": dict(files), "summary": summary.as_dicts(),
            "regions": [_region_dict(r) for r in regions], "dropped": dropped}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def load_run(directory: str | os.PathLike[str]) -> SavedRun:
    """Read ``directory/run.json``.

    Raises:
        FileNotFoundError: No ``run.json`` there (the message says what to run first).
        ValueError: The file is not a run perfsdk wrote (the message says which part).
    """
    path = Path(directory) / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: `perfsdk run SCRIPT` or `perfsdk demo` "
                                "writes it (see --output-dir)")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        rows = tuple(RegionStats(**row) for row in data["summary"])
        regions = tuple(_region(r) for r in data["regions"])
        return SavedRun(tuple(data["command"]), int(data["exit_code"]), float(data["wall_s"]),
                        dict(data["files"]), Summary(rows), regions, int(data["dropped"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a perfsdk run file: {exc}") from None
