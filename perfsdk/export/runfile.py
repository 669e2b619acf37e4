"""A run as the ``perfsdk`` command keeps it: every region recorded while it ran (a pipeline
sink), and ``run.json`` in the output directory, from which ``perfsdk report DIR`` renders the
summary and the advice again.

``run.json`` holds what the command was, its exit code and wall time, the paths of the files
written beside it (trace, spans), the summary rows, and the regions themselves (name, times,
attributes, error type and message), so the advice can be derived again from the data rather
than copied. It is written readable by its owner alone (mode 0600), and the command line is
kept with secret-looking values redacted (:func:`redact_command`). ``perfsdk compare BASE NEW``
(:func:`perfsdk.bench.compare_runs`) reads the per-call times of two saved runs from their
regions.

It sits with the sinks (its recorder is one) so that a capability such as :mod:`perfsdk.bench`
can read saved runs; :mod:`perfsdk.cli.runfile` is its old import path.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from perfsdk.errors import warn_once
from perfsdk.export.summary import RegionStats, Summary, SummarySink
from perfsdk.pipeline import PIPELINE
from perfsdk.record import RegionResult, to_result
from perfsdk.sync.report import SyncSite

__all__ = ["REDACTED", "RUN_FILE", "RunRecorder", "SavedRun", "is_secret_name", "load_run",
           "redact_command", "save_run"]

RUN_FILE = "run.json"
FORMAT = 1
MAX_REGIONS = 200_000
"""Regions a :class:`RunRecorder` keeps; later ones are counted in ``dropped``, not kept."""

REDACTED = "<redacted>"
"""What :func:`redact_command` puts in place of a secret-looking value."""

SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "token",
                          "credential", "credentials", "auth", "authorization", "apikey",
                          "cookie"})
"""A name holding one of these words (split at ``-``, ``_``, ``.`` and camelCase) is secret."""

SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"),
                          ("secret", "key"), ("session", "key")})
"""... and so is one holding one of these pairs of words in a row (``--api-key``, ``apiKey``)."""

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^/\s:@]*:)([^/\s@]+)(@)")


def is_secret_name(name: str) -> bool:
    """Whether an option or variable named ``name`` looks like it holds a secret: one of its
    words is in :data:`SECRET_WORDS` or two in a row are in :data:`SECRET_PAIRS`
    (``--password``, ``--hf-token``, ``HF_TOKEN``, ``--client-secret``, ``apiKey``; neither
    ``--tokenizer`` nor ``--max-tokens``).

    Example:
        >>> [is_secret_name(n) for n in ("--api-key", "WANDB_API_KEY", "--tokenizer",
        ...                              "--max-tokens")]
        [True, True, False, False]
    """
    words = [w for w in re.split(r"[^a-z0-9]+", _CAMEL.sub("_", name).lower()) if w]
    return bool(SECRET_WORDS.intersection(words)) or any(
        pair in SECRET_PAIRS for pair in itertools.pairwise(words))


def redact_command(command: Sequence[str]) -> list[str]:
    """``command`` (a script and its arguments) with secret-looking values replaced by
    :data:`REDACTED`, as ``run.json`` keeps it:

    - the value of an option whose name :func:`is_secret_name`: ``--password=VALUE``, and
      ``--token VALUE`` (the next argument, unless it starts with ``--``);
    - the value of a ``NAME=VALUE`` argument with such a name (``HF_TOKEN=...``,
      ``db.password=...``);
    - the password of a URL (``https://user:PASSWORD@host``), anywhere.

    The first item (the script) is kept as it is. Over-redacting a harmless value is the
    accepted cost: the command is a record, not something perfsdk runs again.

    Example:
        >>> command = redact_command(["train.py", "--token", "abc", "--api-key=xyz",
        ...                           "HF_TOKEN=hf_1", "--tokenizer", "gpt2"])
        >>> " ".join(command)
        'train.py --token <redacted> --api-key=<redacted> HF_TOKEN=<redacted> --tokenizer gpt2'
    """
    out = list(command[:1])
    value_is_secret = False
    for arg in command[1:]:
        if value_is_secret and not arg.startswith("--"):
            out.append(REDACTED)
            value_is_secret = False
            continue
        value_is_secret = False
        if arg.startswith("-") and arg.strip("-"):
            name, eq, _ = arg.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{name}={REDACTED}")
                else:
                    out.append(arg)
                    value_is_secret = True
                continue
        elif "=" in arg:
            name, _, _ = arg.partition("=")
            if is_secret_name(name):
                out.append(f"{name}={REDACTED}")
                continue
        out.append(_URL_PASSWORD.sub(rf"\1{REDACTED}\3", arg))
    return out


class RunRecorder:
    """A pipeline sink keeping every resolved region (bounded; :attr:`regions`), and the run's
    own summary (:meth:`summary`: the regions it saw, whether kept or not), while it is entered
    (``with RunRecorder() as recorder:``)."""

    def __init__(self, limit: int = MAX_REGIONS) -> None:
        self.limit = limit
        self.dropped = 0
        self._records: list[Any] = []
        self._regions: list[RegionResult] = []
        self._lock = threading.Lock()
        self._summary = SummarySink()

    @property
    def regions(self) -> list[RegionResult]:
        """The regions kept, as :class:`RegionResult` s. The pipeline thread keeps their
        records; each is made a ``RegionResult`` at the first read after it arrived (about
        5 us a region, for the run's report after the script: not while the training loop
        shares the GIL with the pipeline thread)."""
        with self._lock:
            made = len(self._regions)
            if made < len(self._records):
                self._regions.extend(to_result(r) for r in self._records[made:])
            return list(self._regions)

    def summary(self) -> Summary:
        """The summary of the regions this recorder saw (not of the whole process, unlike
        :func:`perfsdk.summary`)."""
        return self._summary.snapshot()

    def tally(self, overflow: dict[int, list[int]]) -> None:
        self._summary.tally(overflow)

    def consume(self, records: list[Any]) -> None:
        self._summary.consume(records)
        with self._lock:
            room = self.limit - len(self._records)
            self._records.extend(records[:max(room, 0)])
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
    """Write ``run.json`` in ``directory`` (atomically, mode 0600, the command redacted by
    :func:`redact_command`) and return its path."""
    path = Path(directory) / RUN_FILE
    data = {"format": FORMAT, "command": redact_command(command), "exit_code": exit_code,
            "wall_s": wall_s, "files": dict(files), "summary": summary.as_dicts(),
            "sync_sites": [dataclasses.asdict(site) for site in summary.sync_sites],
            "regions": [_region_dict(r) for r in regions], "dropped": dropped}
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8") as file:
        if hasattr(os, "fchmod"):  # a .tmp left by an earlier run keeps its mode otherwise
            os.fchmod(file.fileno(), 0o600)
        file.write(json.dumps(data, indent=1, default=str) + "\n")
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
        sites = tuple(SyncSite(**{**site, "outside_ns": tuple(site.get("outside_ns", ()))})
                      for site in data.get("sync_sites", ()))  # absent from older files
        regions = tuple(_region(r) for r in data["regions"])
        return SavedRun(tuple(data["command"]), int(data["exit_code"]), float(data["wall_s"]),
                        dict(data["files"]), Summary(rows, sites), regions,
                        int(data["dropped"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a perfsdk run file: {exc}") from None
