"""Pytest-facing helpers for the NVTX recording injection library (``recorder.c``).

Typical use::

    lib = build_library(tmp_dir)                  # RuntimeError -> pytest.skip
    events = run_with_recorder(code, lib, tmp_path)
    rs = ranges(events)                           # closed push/pop ranges

NVTX reads ``NVTX_INJECTION64_PATH`` once, at the first NVTX call in a process,
so every scenario runs in a fresh ``sys.executable -c code`` subprocess.

Event dicts (one per JSON line written by the library) always carry
``seq`` (per-process write order), ``kind``, ``pid``, ``thread`` (OS tid from
gettid), ``ts_ns`` (CLOCK_MONOTONIC) and ``domain`` (``""`` = default domain).
Per kind:

* ``init``: ``nvtx_version``, ``init_count`` (one per NVTX copy that attaches)
* ``push`` / ``mark`` / ``start``: ``message`` (text, registered handles are
  resolved), ``message_type`` (``"ascii"``/``"unicode"``/``"registered"``/None),
  ``color`` (ARGB int, None unless colorType is ARGB), ``category`` (int, 0 =
  none), ``payload`` and ``payload_type`` (``"int64"``, ``"uint64"``,
  ``"int32"``, ``"uint32"``, ``"double"``, ``"float"``, ``"ext"`` (payload is
  then a list of ``{"schema_id", "size"}``) or None); ``push`` adds ``level``,
  ``start`` adds ``range_id``
* ``pop``: ``level`` (-1 when nothing was open); ``end``: ``range_id``
* ``domain_create`` / ``domain_destroy``: only the common fields
* ``category``: ``category`` (id), ``name``
* ``register_string``: ``message`` (the registered text)
* ``thread_name``: ``os_thread_id``, ``name``
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "LIB_NAME",
    "SOURCE",
    "Event",
    "Range",
    "build_library",
    "find_compiler",
    "find_nvtx_include",
    "ranges",
    "read_events",
    "run_with_recorder",
    "start_end_ranges",
    "unbalanced",
]

SOURCE: Path = Path(__file__).with_name("recorder.c")
LIB_NAME = "librecorder.so"
REPO_ROOT: Path = Path(__file__).resolve().parents[2]

Event = dict[str, Any]
Range = dict[str, Any]

_NVTX_HEADER = Path("nvtx3") / "nvToolsExt.h"
_ATTRIBUTE_FIELDS = ("message", "color", "category", "payload", "payload_type")


# --------------------------------------------------------------------------- build


def find_compiler() -> list[str] | None:
    """The C compiler command ($CC, else cc/gcc/clang on PATH), or None."""
    cc_env = os.environ.get("CC", "").strip()
    if cc_env:
        argv = shlex.split(cc_env)
        if shutil.which(argv[0]):
            return argv
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _include_candidates() -> list[Path]:
    candidates: list[Path] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).parent.parent / "include")
        # /usr/local/bin/nvcc may be a symlink (or wrapper) into a CUDA tree.
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            candidates.append(Path(root) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    candidates.extend(sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True))
    return candidates


def find_nvtx_include() -> Path:
    """Directory holding ``nvtx3/nvToolsExt.h``.

    ``$NVTX_INCLUDE_DIR`` wins when set; otherwise the include dir beside
    ``nvcc``, ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda/include`` and
    ``/usr/local/cuda-*/include`` are tried. Raises RuntimeError if none has it.
    """
    explicit = os.environ.get("NVTX_INCLUDE_DIR")
    if explicit:
        if (Path(explicit) / _NVTX_HEADER).is_file():
            return Path(explicit)
        raise RuntimeError(f"NVTX_INCLUDE_DIR={explicit!r} does not contain {_NVTX_HEADER}")
    candidates = _include_candidates()
    for candidate in candidates:
        if (candidate / _NVTX_HEADER).is_file():
            return candidate
    looked = ", ".join(dict.fromkeys(str(c) for c in candidates))
    raise RuntimeError(
        f"NVTX v3 headers ({_NVTX_HEADER}) not found; looked in: {looked}. "
        "Set NVTX_INCLUDE_DIR to a directory containing nvtx3/."
    )


def build_library(out_dir: Path) -> Path:
    """Compile ``recorder.c`` into ``out_dir/librecorder.so`` and return its path.

    The result is cached: it is rebuilt only when the source, compiler or
    include directory change. Raises RuntimeError naming what is missing (C
    compiler or NVTX headers) or the compiler output if compilation fails.
    """
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc and clang all missing)")
    include = find_nvtx_include()
    if not SOURCE.is_file():
        raise RuntimeError(f"recorder source missing: {SOURCE}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIB_NAME
    stamp = out_dir / (LIB_NAME + ".stamp")

    def command(output: Path) -> list[str]:
        return [
            *compiler,
            "-shared",
            "-fPIC",
            "-O2",
            f"-I{include}",
            "-o",
            str(output),
            str(SOURCE),
            "-lpthread",
        ]

    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update("\0".join(command(lib)).encode())
    key = digest.hexdigest()
    if lib.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        return lib

    tmp = out_dir / f"{LIB_NAME}.tmp.{os.getpid()}"
    proc = subprocess.run(command(tmp), capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(
            f"compiling {SOURCE.name} failed (rc={proc.returncode}): "
            f"{shlex.join(command(lib))}\n{proc.stdout}{proc.stderr}"
        )
    os.replace(tmp, lib)
    stamp.write_text(key + "\n")
    return lib


# ----------------------------------------------------------------------------- run


def read_events(path: Path) -> list[Event]:
    """Parse a JSONL record file (missing file -> []).

    A truncated final line (process killed mid-write) is ignored.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    events: list[Event] = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if index == len(lines) - 1:  # no trailing newline: partial write
                break
            raise AssertionError(f"{path}:{index + 1}: bad NVTX record line {line!r}") from None
    return events


def run_with_recorder(
    code: str,
    lib: Path,
    tmp_path: Path,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 120,
    *,
    expect_returncode: int | None = 0,
    cwd: Path | None = None,
) -> list[Event]:
    """Run ``sys.executable -c code`` with the recorder injected; return its events.

    The child gets ``NVTX_INJECTION64_PATH=lib``, a fresh ``NVTX_RECORD_PATH``
    under ``tmp_path`` and the repository root prepended to ``PYTHONPATH``.
    ``env`` entries override (a value of None removes the variable). Asserts the
    exit status equals ``expect_returncode`` (None: don't check), showing the
    child's stdout/stderr otherwise. Runs in ``cwd`` (default ``tmp_path``).
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="nvtx_events_", suffix=".jsonl", dir=tmp_path)
    os.close(fd)
    record = Path(name)

    child_env = dict(os.environ)
    pythonpath = child_env.get("PYTHONPATH")
    child_env["PYTHONPATH"] = (
        f"{REPO_ROOT}{os.pathsep}{pythonpath}" if pythonpath else str(REPO_ROOT)
    )
    child_env["NVTX_INJECTION64_PATH"] = str(Path(lib).resolve())
    child_env["NVTX_RECORD_PATH"] = str(record)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value

    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=child_env,
            cwd=str(cwd if cwd is not None else tmp_path),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"NVTX scenario timed out after {timeout}s (record: {record})\n"
            f"--- stdout ---\n{_text(exc.stdout)}\n--- stderr ---\n{_text(exc.stderr)}"
        ) from None

    if expect_returncode is not None and proc.returncode != expect_returncode:
        raise AssertionError(
            f"NVTX scenario exited with {proc.returncode}, expected {expect_returncode} "
            f"(record: {record})\n--- code ---\n{code}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return read_events(record)


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data


# -------------------------------------------------------------------------- ranges


def _pair_push_pop(events: Iterable[Event]) -> tuple[list[Range], list[str]]:
    stacks: dict[tuple[Any, Any, str], list[tuple[int, Event]]] = {}
    closed: list[tuple[int, Range]] = []
    problems: list[str] = []
    for order, event in enumerate(events):
        kind = event.get("kind")
        if kind not in ("push", "pop"):
            continue
        key = (event.get("pid"), event.get("thread"), event.get("domain", ""))
        stack = stacks.setdefault(key, [])
        if kind == "push":
            stack.append((order, event))
            continue
        if not stack:
            problems.append(
                f"pop without open range: pid={key[0]} thread={key[1]} "
                f"domain={key[2]!r} seq={event.get('seq')}"
            )
            continue
        push_order, push = stack.pop()
        rng: Range = {"domain": key[2]}
        for field in _ATTRIBUTE_FIELDS:
            rng[field] = push.get(field)
        rng.update(
            thread=key[1],
            pid=key[0],
            depth=len(stack),
            path=(*(p.get("message") for _, p in stack), push.get("message")),
            start_ns=push.get("ts_ns"),
            end_ns=event.get("ts_ns"),
            push_seq=push.get("seq"),
            pop_seq=event.get("seq"),
        )
        closed.append((push_order, rng))
    for (pid, thread, domain), stack in stacks.items():
        for _, push in stack:
            problems.append(
                f"push {push.get('message')!r} never popped: pid={pid} thread={thread} "
                f"domain={domain!r} seq={push.get('seq')}"
            )
    closed.sort(key=lambda item: item[0])
    return [rng for _, rng in closed], problems


def unbalanced(events: Iterable[Event]) -> list[str]:
    """Human-readable descriptions of unmatched pushes and pops (empty if balanced)."""
    return _pair_push_pop(events)[1]


def ranges(events: Iterable[Event], *, allow_unbalanced: bool = False) -> list[Range]:
    """Pair push/pop events per (pid, thread, domain) stack into closed ranges.

    Ranges come back in push order, each with ``domain``, ``message``,
    ``color``, ``category``, ``payload``, ``payload_type``, ``thread``, ``pid``,
    ``depth`` (0 = outermost on its thread+domain stack), ``path`` (tuple of
    messages from the outermost range down to this one), ``start_ns``,
    ``end_ns``, ``push_seq`` and ``pop_seq``. Unmatched pushes/pops raise
    AssertionError unless ``allow_unbalanced`` (then they are left out).
    """
    closed, problems = _pair_push_pop(events)
    if problems and not allow_unbalanced:
        raise AssertionError("unbalanced NVTX push/pop:\n  " + "\n  ".join(problems))
    return closed


def start_end_ranges(events: Iterable[Event], *, allow_unbalanced: bool = False) -> list[Range]:
    """Pair start/end events by (pid, range_id) into ranges, in start order.

    Fields: ``domain``, ``message``, ``color``, ``category``, ``payload``,
    ``payload_type``, ``range_id``, ``pid``, ``start_thread``, ``end_thread``,
    ``start_ns``, ``end_ns``. Unmatched starts/ends raise AssertionError unless
    ``allow_unbalanced``.
    """
    open_ranges: dict[tuple[Any, Any], tuple[int, Event]] = {}
    result: list[tuple[int, Range]] = []
    problems: list[str] = []
    for order, event in enumerate(events):
        kind = event.get("kind")
        if kind not in ("start", "end"):
            continue
        key = (event.get("pid"), event.get("range_id"))
        if kind == "start":
            open_ranges[key] = (order, event)
            continue
        opened = open_ranges.pop(key, None)
        if opened is None:
            problems.append(f"end of unknown range_id={key[1]} pid={key[0]}")
            continue
        start_order, start = opened
        rng: Range = {"domain": start.get("domain", "")}
        for field in _ATTRIBUTE_FIELDS:
            rng[field] = start.get(field)
        rng.update(
            range_id=key[1],
            pid=key[0],
            start_thread=start.get("thread"),
            end_thread=event.get("thread"),
            start_ns=start.get("ts_ns"),
            end_ns=event.get("ts_ns"),
        )
        result.append((start_order, rng))
    for (pid, range_id), (_, start) in open_ranges.items():
        problems.append(
            f"start {start.get('message')!r} never ended: range_id={range_id} pid={pid}"
        )
    if problems and not allow_unbalanced:
        raise AssertionError("unbalanced NVTX start/end:\n  " + "\n  ".join(problems))
    result.sort(key=lambda item: item[0])
    return [rng for _, rng in result]
