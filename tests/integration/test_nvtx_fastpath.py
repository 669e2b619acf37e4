"""NVTX-only mode's short path, compiled and pure Python, through the NVTX injection library.

``@profiled`` in NVTX-only mode (``PERFSDK_TIMING=0``) pushes, calls and pops in one C call where
perfsdk's compiled module is built (``perfsdk._fastpath.NvtxCall``), else inline in Python
(``PERFSDK_DISABLE_EXTENSIONS=1``). Every scenario here runs under both and must record the
same ranges: names, nesting with the ``nvtx`` package's own ranges (``timed_region``) on the
same domain stack, colors, categories, payloads, exceptions, threads, recursion, and the
switches that send a call back through the gate.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from tests.nvtx_injection.recorder import Event, Range, ranges, run_with_recorder

pytestmark = pytest.mark.skipif(find_spec("nvtx") is None, reason="nvtx package not installed")


def _compiled_nvtx_built() -> bool:
    try:
        from perfsdk import _fastpath
    except ImportError:
        return False
    return bool(_fastpath.HAVE_NVTX)


PATHS = [
    pytest.param("compiled", marks=pytest.mark.skipif(
        not _compiled_nvtx_built(), reason="perfsdk._fastpath is not built with NVTX")),
    "python",
]

SCENARIO = r"""
import threading

import perfsdk
from perfsdk import markers, profiled, timed_region
from perfsdk.config import state

assert state.nvtx_only, "the scenario runs in NVTX-only mode"


@profiled("fp.outer", category="phase", payload=42)
def outer(x, *, y=0):
    with timed_region("fp.block", category="phase"):
        return inner(x) + inner(y)


@profiled("fp.inner", color="green")
def inner(v):
    return v * 2


compiled = outer.__perfsdk_spec__.nvtx.call is not None
assert compiled == (PATH == "compiled"), (PATH, compiled, markers.compiled_nvtx())
assert outer(1, y=2) == 6

# -- a custom domain, a category, the smallest int64 payload ---------------------------------
@profiled("fp.dom", domain="perfsdk.fp", category="io", color="#80112233", payload=-(2**63))
def in_domain():
    with timed_region("fp.dom_block", domain="perfsdk.fp"):
        pass


in_domain()

# -- exceptions pass through unchanged -------------------------------------------------------
class Boom(Exception):
    pass


error = Boom("boom")


@profiled("fp.raises")
def raises():
    raise error


@profiled("fp.catches")
def catches():
    try:
        raises()
    except Boom as exc:
        return exc
    return None


assert catches() is error
try:
    raises()
except Boom as exc:
    assert exc is error
    assert exc.__traceback__ is not None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "raises", frames
else:
    raise SystemExit("the exception was swallowed")


# -- recursion and methods -------------------------------------------------------------------
@profiled("fp.rec")
def rec(n):
    return 0 if n == 0 else 1 + rec(n - 1)


assert rec(4) == 4


class Model:
    def __init__(self):
        self.k = 3

    @profiled("fp.method")
    def forward(self, x):
        return self.k * x

    @profiled("fp.cls")
    @classmethod
    def make(cls):
        return cls()


assert Model.make().forward(2) == 6

# -- threads ---------------------------------------------------------------------------------
inside = threading.Barrier(4)


@profiled("fp.thr")
def thr(n):
    if n == 0:
        inside.wait()  # all four threads hold an open range at once here


def work():
    for n in range(20):
        thr(n)


threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()

# -- what goes back through the gate ---------------------------------------------------------
@profiled("fp.sampled", every=3)
def sampled():
    pass


for _ in range(6):
    sampled()  # every=3 of its own: 2 ranges

perfsdk.configure(sample_every=2)
assert not state.nvtx_only
for _ in range(4):
    inner(0)  # PERFSDK_SAMPLE_EVERY=2: 2 ranges
perfsdk.configure(sample_every=1, nvtx=False)
inner(0)  # no range
perfsdk.configure(nvtx=True, enabled=False)
inner(0)  # no range
perfsdk.configure(enabled=True, timing=True)
assert inner(5) == 10  # a full, timed region (its range through the Region)
perfsdk.flush()
rows = {row.name: row.count for row in perfsdk.summary(show=False)}
assert rows == {"fp.inner": 1}, rows
perfsdk.configure(timing=False)
assert state.nvtx_only
with timed_region("fp.end"):
    pass

# -- inside torch.compile the wrapper steps aside: no graph break (fullgraph raises on one) -----
import torch


@profiled("fp.compiled_inner")
def compiled_inner(x):
    return torch.sin(x) * 2


def model(x):
    return compiled_inner(x) + 1


x = torch.randn(4)
compiled = torch.compile(model, fullgraph=True, backend="eager")
torch.testing.assert_close(compiled(x), model(x))
"""


def _scenario(nvtx_lib: Path, tmp_path: Path, path: str) -> list[Event]:
    env: dict[str, str | None] = {"PERFSDK_TIMING": "0", "PERFSDK_EXPORTER": "none",
                                  "PERFSDK_SAMPLE_EVERY": None, "PERFSDK_NVTX": None,
                                  "PERFSDK_ENABLED": None}
    env["PERFSDK_DISABLE_EXTENSIONS"] = "1" if path == "python" else None
    code = f"PATH = {path!r}\n" + textwrap.dedent(SCENARIO)
    events = run_with_recorder(code, nvtx_lib, tmp_path, env)
    assert any(e["kind"] == "init" for e in events), "the injection library was not loaded"
    return events


@pytest.fixture(scope="module")
def scenario_events(nvtx_lib: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = {}
    for path in ("compiled", "python"):
        if path == "compiled" and not _compiled_nvtx_built():
            continue
        out[path] = _scenario(nvtx_lib, tmp_path_factory.mktemp(f"fp_{path}"), path)
    return out


def _events(scenario_events: dict[str, list[Event]], path: str) -> list[Event]:
    return scenario_events[path]


def _named(rs: list[Range], prefix: str) -> list[Range]:
    return [r for r in rs if str(r["message"]).startswith(prefix)]


def _shape(r: Range) -> tuple[Any, ...]:
    return (r["domain"], r["message"], r["color"], r["category"], r["payload"],
            r["payload_type"], r["path"], r["depth"])


@pytest.mark.parametrize("path", PATHS)
def test_names_nesting_and_one_domain_stack(scenario_events: dict[str, list[Event]],
                                            path: str) -> None:
    events = _events(scenario_events, path)
    rs = _named(ranges(events), "fp.")  # raises on any unbalanced push/pop
    first = [(r["message"], r["path"], r["domain"]) for r in rs[:5]]
    assert first == [
        ("fp.outer", ("fp.outer",), "perfsdk"),
        ("fp.block", ("fp.outer", "fp.block"), "perfsdk"),
        ("fp.inner", ("fp.outer", "fp.block", "fp.inner"), "perfsdk"),
        ("fp.inner", ("fp.outer", "fp.block", "fp.inner"), "perfsdk"),
        ("fp.dom", ("fp.dom",), "perfsdk.fp"),
    ]
    # The tool's own nesting level counts per domain handle: the compiled path's ranges and the
    # nvtx package's (fp.block) share the domain's handle, so levels run 0, 1, 2.
    pushes = [(e["message"], e["level"]) for e in events if e["kind"] == "push"]
    assert pushes[:4] == [("fp.outer", 0), ("fp.block", 1), ("fp.inner", 2), ("fp.inner", 2)]
    assert all(e["message_type"] == "registered" for e in events if e["kind"] == "push")


@pytest.mark.parametrize("path", PATHS)
def test_attributes(scenario_events: dict[str, list[Event]], path: str) -> None:
    events = _events(scenario_events, path)
    by_name = {r["message"]: r for r in ranges(events)}
    categories = {(e["domain"], e["name"]): e["category"] for e in events
                  if e["kind"] == "category"}
    outer, inner, dom = by_name["fp.outer"], by_name["fp.inner"], by_name["fp.dom"]
    assert outer["category"] == categories[("perfsdk", "phase")] != 0
    assert by_name["fp.block"]["category"] == outer["category"]
    assert (outer["payload"], outer["payload_type"]) == (42, "int64")
    assert inner["color"] == 0xFF008000
    assert (inner["payload_type"], inner["category"]) == (None, 0)
    assert dom["category"] == categories[("perfsdk.fp", "io")] != 0
    assert dom["color"] == 0x80112233
    assert (dom["payload"], dom["payload_type"]) == (-(2**63), "int64")
    # each category is named once per domain, by the nvtx package, however many paths use it
    assert Counter((e["domain"], e["name"]) for e in events if e["kind"] == "category") == {
        ("perfsdk", "phase"): 1, ("perfsdk.fp", "io"): 1}


@pytest.mark.parametrize("path", PATHS)
def test_exceptions_close_the_range(scenario_events: dict[str, list[Event]], path: str) -> None:
    rs = ranges(_events(scenario_events, path))
    assert [r["path"] for r in rs if r["message"] in ("fp.catches", "fp.raises")] == [
        ("fp.catches",), ("fp.catches", "fp.raises"), ("fp.raises",)]


@pytest.mark.parametrize("path", PATHS)
def test_recursion_and_methods(scenario_events: dict[str, list[Event]], path: str) -> None:
    rs = ranges(_events(scenario_events, path))
    assert [r["depth"] for r in rs if r["message"] == "fp.rec"] == [0, 1, 2, 3, 4]
    assert [r["message"] for r in rs if r["message"] in ("fp.cls", "fp.method")] == [
        "fp.cls", "fp.method"]


@pytest.mark.parametrize("path", PATHS)
def test_threads(scenario_events: dict[str, list[Event]], path: str) -> None:
    events = _events(scenario_events, path)
    rs = [r for r in ranges(events) if r["message"] == "fp.thr"]
    per_thread = Counter(r["thread"] for r in rs)
    assert len(per_thread) == 4
    assert set(per_thread.values()) == {20}
    assert all(r["depth"] == 0 for r in rs)
    # the four n == 0 ranges were open at the same time
    first = sorted(rs, key=lambda r: r["push_seq"])[:4]
    assert max(r["push_seq"] for r in first) < min(r["pop_seq"] for r in first)


@pytest.mark.parametrize("path", PATHS)
def test_switches_go_through_the_gate(scenario_events: dict[str, list[Event]],
                                      path: str) -> None:
    rs = ranges(_events(scenario_events, path))
    assert sum(r["message"] == "fp.sampled" for r in rs) == 2
    inner = [r for r in rs if r["message"] == "fp.inner"]
    assert len(inner) == 2 + 2 + 1  # outer()'s two, sample_every=2's two, the timed one
    assert [r["message"] for r in rs[-2:]] == ["fp.end", "fp.compiled_inner"]  # eager call only


def test_both_paths_record_the_same_ranges(scenario_events: dict[str, list[Event]]) -> None:
    if "compiled" not in scenario_events:
        pytest.skip("perfsdk._fastpath is not built with NVTX")
    compiled = [_shape(r) for r in ranges(scenario_events["compiled"]) if r["message"] != "fp.thr"]
    python = [_shape(r) for r in ranges(scenario_events["python"]) if r["message"] != "fp.thr"]
    assert compiled == python
