"""Prove the NVTX recording injection library (tests/nvtx_injection) against real NVTX.

No perfsdk code is involved: every scenario drives the plain ``nvtx`` package (or
the NVTX C API through a tiny probe library) in a subprocess with the recorder
injected via NVTX_INJECTION64_PATH, then checks the recorded events.
"""

# The imported `nvtx_lib` fixture is (by design) shadowed by test parameters.
# ruff: noqa: F811

from __future__ import annotations

import subprocess
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.nvtx_injection.fixtures import nvtx_lib  # noqa: F401
from tests.nvtx_injection.recorder import (
    Event,
    find_compiler,
    find_nvtx_include,
    ranges,
    read_events,
    run_with_recorder,
    start_end_ranges,
    unbalanced,
)

pytestmark = pytest.mark.skipif(find_spec("nvtx") is None, reason="nvtx package not installed")


def _run(
    code: str,
    lib: Path,
    tmp_path: Path,
    *,
    env: dict[str, str | None] | None = None,
    expect_returncode: int | None = 0,
) -> list[Event]:
    return run_with_recorder(
        textwrap.dedent(code), lib, tmp_path, env, expect_returncode=expect_returncode
    )


def _of_kind(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e["kind"] == kind]


def test_nested_annotate_in_named_domain(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import nvtx
        with nvtx.annotate("outer", color=0xFF112233, domain="rec.test", category=7, payload=42):
            with nvtx.annotate("inner", color=0x80445566, domain="rec.test", category=8,
                               payload=2.5):
                pass
        """,
        nvtx_lib,
        tmp_path,
    )
    assert _of_kind(events, "init"), "injection library was not initialized"
    assert [e["domain"] for e in _of_kind(events, "domain_create")] == ["rec.test"]

    rs = ranges(events)
    assert [r["path"] for r in rs] == [("outer",), ("outer", "inner")]
    outer, inner = rs
    assert outer["domain"] == inner["domain"] == "rec.test"
    assert (outer["color"], outer["category"]) == (0xFF112233, 7)
    assert (outer["payload"], outer["payload_type"]) == (42, "int64")
    assert (inner["color"], inner["category"]) == (0x80445566, 8)
    assert (inner["payload"], inner["payload_type"]) == (2.5, "double")
    assert (outer["depth"], inner["depth"]) == (0, 1)
    assert outer["thread"] == inner["thread"]
    assert outer["start_ns"] <= inner["start_ns"] <= inner["end_ns"] <= outer["end_ns"]
    assert outer["push_seq"] < inner["push_seq"] < inner["pop_seq"] < outer["pop_seq"]

    pushes = _of_kind(events, "push")
    assert all(p["message_type"] == "registered" for p in pushes)
    assert [p["level"] for p in pushes] == [0, 1]
    assert [p["level"] for p in _of_kind(events, "pop")] == [1, 0]


def test_push_pop_default_domain(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import nvtx
        nvtx.push_range("a")
        nvtx.push_range("b", color=0xFF00FF00, payload=-3)
        nvtx.mark("m", payload=1)
        nvtx.pop_range()
        nvtx.pop_range()
        """,
        nvtx_lib,
        tmp_path,
    )
    assert _of_kind(events, "domain_create") == []
    rs = ranges(events)
    assert [(r["message"], r["domain"], r["depth"]) for r in rs] == [("a", "", 0), ("b", "", 1)]
    assert rs[0]["color"] == 0x0000FF  # nvtx's default "blue", alpha 0
    assert (rs[0]["payload"], rs[0]["payload_type"]) == (None, None)
    assert (rs[1]["color"], rs[1]["payload"], rs[1]["payload_type"]) == (0xFF00FF00, -3, "int64")
    (mark,) = _of_kind(events, "mark")
    assert (mark["message"], mark["domain"], mark["payload"]) == ("m", "", 1)


def test_registered_string_is_resolved(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import nvtx
        d = nvtx.get_domain("rec.strings")
        s = d.get_registered_string("pre-registered \\"quoted\\" é")
        attrs = d.get_event_attributes(color=0xFFABCDEF)
        attrs.message = s
        d.push_range(attrs)
        d.mark(attrs)
        d.pop_range()
        """,
        nvtx_lib,
        tmp_path,
    )
    text = 'pre-registered "quoted" é'
    (registered,) = _of_kind(events, "register_string")
    assert (registered["domain"], registered["message"]) == ("rec.strings", text)
    (rng,) = ranges(events)
    assert (rng["message"], rng["domain"], rng["color"]) == (text, "rec.strings", 0xFFABCDEF)
    (push,) = _of_kind(events, "push")
    assert push["message_type"] == "registered"
    (mark,) = _of_kind(events, "mark")
    assert mark["message"] == text


def test_two_threads_keep_separate_stacks(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import threading
        import nvtx

        barrier = threading.Barrier(2)

        def work(name):
            nvtx.mark(str(threading.get_native_id()), domain="rec.threads")
            barrier.wait()
            with nvtx.annotate(name + "-outer", domain="rec.threads"):
                barrier.wait()  # both outers are open before either inner starts
                with nvtx.annotate(name + "-inner", domain="rec.threads"):
                    barrier.wait()
                barrier.wait()  # both inners closed before either outer closes

        threads = [threading.Thread(target=work, args=(n,)) for n in ("t1", "t2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        """,
        nvtx_lib,
        tmp_path,
    )
    # The recorder's thread id is the OS tid (== threading.get_native_id()).
    marks = _of_kind(events, "mark")
    assert len(marks) == 2
    assert all(m["thread"] == int(m["message"]) for m in marks)

    rs = ranges(events)
    assert len(rs) == 4
    by_thread: dict[int, list[tuple[str, ...]]] = {}
    for r in rs:
        by_thread.setdefault(r["thread"], []).append(r["path"])
    assert len(by_thread) == 2
    assert {m["thread"] for m in marks} == set(by_thread)
    for paths in by_thread.values():
        name = paths[0][0].split("-")[0]
        assert paths == [(f"{name}-outer",), (f"{name}-outer", f"{name}-inner")]

    # The pushes really interleaved across threads, so one shared stack would mis-pair.
    kinds = [(e["kind"], e["message"]) for e in events if e["kind"] == "push"]
    assert {m for _, m in kinds[:2]} == {"t1-outer", "t2-outer"}
    assert {m for _, m in kinds[2:]} == {"t1-inner", "t2-inner"}
    assert {tuple(p["level"] for p in _of_kind(events, "push"))} == {(0, 0, 1, 1)}


def test_category_name_is_recorded(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import nvtx
        d = nvtx.get_domain("rec.cats")
        explicit = d.get_category_id("explicit")
        with nvtx.annotate("work", domain="rec.cats", category="phase"):
            pass
        print(explicit)
        """,
        nvtx_lib,
        tmp_path,
    )
    cats = _of_kind(events, "category")
    assert [(c["domain"], c["category"], c["name"]) for c in cats] == [
        ("rec.cats", 1, "explicit"),
        ("rec.cats", 2, "phase"),
    ]
    (rng,) = ranges(events)
    assert (rng["message"], rng["category"]) == ("work", 2)


def test_start_end_range(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import threading
        import nvtx
        rid = nvtx.start_range("cross-thread", domain="rec.se", payload=9)
        t = threading.Thread(target=nvtx.end_range, args=(rid,))
        t.start()
        t.join()
        """,
        nvtx_lib,
        tmp_path,
    )
    assert ranges(events) == []
    (rng,) = start_end_ranges(events)
    assert (rng["message"], rng["domain"], rng["payload"]) == ("cross-thread", "rec.se", 9)
    assert rng["start_thread"] != rng["end_thread"]
    assert rng["start_ns"] <= rng["end_ns"]


def test_unbalanced_push_is_reported(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import nvtx
        nvtx.push_range("closed")
        nvtx.pop_range()
        nvtx.push_range("leaked", domain="rec.leak")
        nvtx.pop_range()  # default domain: nothing open there
        """,
        nvtx_lib,
        tmp_path,
    )
    problems = unbalanced(events)
    assert len(problems) == 2
    assert any("leaked" in p and "never popped" in p for p in problems)
    assert any("pop without open range" in p for p in problems)
    with pytest.raises(AssertionError, match="unbalanced NVTX push/pop"):
        ranges(events)
    assert [r["message"] for r in ranges(events, allow_unbalanced=True)] == ["closed"]
    assert [p["level"] for p in _of_kind(events, "pop")] == [0, -1]


def test_events_survive_abnormal_exit(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import os, signal
        import nvtx
        nvtx.push_range("dying")
        nvtx.mark("last words")
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        nvtx_lib,
        tmp_path,
        expect_returncode=-9,
    )
    assert [e["message"] for e in _of_kind(events, "push")] == ["dying"]
    assert [e["message"] for e in _of_kind(events, "mark")] == ["last words"]
    assert len(ranges(events, allow_unbalanced=True)) == 0


def test_no_record_path_is_harmless(nvtx_lib: Path, tmp_path: Path) -> None:
    events = _run(
        """
        import nvtx
        assert nvtx.enabled()
        with nvtx.annotate("quiet", domain="rec.quiet"):
            nvtx.mark("m")
        """,
        nvtx_lib,
        tmp_path,
        env={"NVTX_RECORD_PATH": None},
    )
    assert events == []


def test_failed_scenario_shows_output(nvtx_lib: Path, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"(?s)exited with 3.*boom-stdout.*boom-stderr"):
        _run(
            """
            import sys
            print("boom-stdout")
            print("boom-stderr", file=sys.stderr)
            sys.exit(3)
            """,
            nvtx_lib,
            tmp_path,
        )


_PROBE_C = r"""
#include <nvtx3/nvToolsExt.h>
#include <string.h>
#include <wchar.h>

static nvtxEventAttributes_t attrs(const char *msg)
{
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof a);
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = msg;
    return a;
}

int probe(void)
{
    nvtxEventAttributes_t a;
    nvtxDomainHandle_t d;
    nvtxRangeId_t r;
    int extra_pop;

    nvtxRangePushA("ascii-outer");

    a = attrs("i32");
    a.payloadType = NVTX_PAYLOAD_TYPE_INT32;
    a.payload.iValue = -5;
    nvtxRangePushEx(&a);
    nvtxRangePop();

    a = attrs("u32");
    a.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT32;
    a.payload.uiValue = 4000000000u;
    nvtxMarkEx(&a);

    a = attrs("u64");
    a.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
    a.payload.ullValue = 18446744073709551615ull;
    nvtxMarkEx(&a);

    a = attrs("f32");
    a.payloadType = NVTX_PAYLOAD_TYPE_FLOAT;
    a.payload.fValue = 0.5f;
    a.category = 4;
    nvtxMarkEx(&a);

    nvtxMarkW(L"wide-\u00e9");
    nvtxMarkA("tab\tnewline\nquote\"");

    d = nvtxDomainCreateA("probe");
    a = attrs(NULL);
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    a.message.registered = nvtxDomainRegisterStringA(d, "reg");
    a.colorType = NVTX_COLOR_ARGB;
    a.color = 0xFF010203u;
    nvtxDomainRangePushEx(d, &a);
    nvtxDomainRangePop(d);

    nvtxRangePop();
    extra_pop = nvtxRangePop();

    nvtxNameCategoryA(4, "cat4");
    nvtxDomainNameCategoryA(d, 1, "dcat1");
    nvtxNameOsThreadA(123, "worker");
    r = nvtxRangeStartA("se");
    nvtxRangeEnd(r);
    nvtxDomainDestroy(d);
    return extra_pop;
}
"""


@pytest.fixture(scope="module")
def nvtx_probe(nvtx_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny C library calling the NVTX C API directly (ASCII/wide/other payloads)."""
    compiler = find_compiler()
    assert compiler is not None  # nvtx_lib was built, so there is one
    out_dir = tmp_path_factory.mktemp("nvtx_probe")
    source = out_dir / "probe.c"
    source.write_text(_PROBE_C)
    lib = out_dir / "libprobe.so"
    cmd = [*compiler, "-shared", "-fPIC", f"-I{find_nvtx_include()}", "-o", str(lib), str(source)]
    proc = subprocess.run([*cmd, "-ldl"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return lib


def test_c_api_message_and_payload_kinds(nvtx_lib: Path, nvtx_probe: Path, tmp_path: Path) -> None:
    events = _run(
        f"""
        import ctypes
        result = ctypes.CDLL({str(nvtx_probe)!r}).probe()
        assert result == -1, result
        """,
        nvtx_lib,
        tmp_path,
    )
    rs = ranges(events, allow_unbalanced=True)
    assert [(r["domain"], r["path"]) for r in rs] == [
        ("", ("ascii-outer",)),
        ("", ("ascii-outer", "i32")),
        ("probe", ("reg",)),
    ]
    assert (rs[0]["color"], rs[0]["payload"]) == (None, None)
    assert (rs[1]["payload"], rs[1]["payload_type"]) == (-5, "int32")
    assert rs[2]["color"] == 0xFF010203
    (problem,) = unbalanced(events)
    assert "pop without open range" in problem

    marks = {m["message"]: m for m in _of_kind(events, "mark")}
    assert (marks["u32"]["payload"], marks["u32"]["payload_type"]) == (4000000000, "uint32")
    assert (marks["u64"]["payload"], marks["u64"]["payload_type"]) == (2**64 - 1, "uint64")
    assert (marks["f32"]["payload"], marks["f32"]["payload_type"]) == (0.5, "float")
    assert marks["f32"]["category"] == 4
    assert marks["wide-é"]["message_type"] == "unicode"
    assert marks['tab\tnewline\nquote"']["message_type"] == "ascii"

    cats = [(c["domain"], c["category"], c["name"]) for c in _of_kind(events, "category")]
    assert cats == [("", 4, "cat4"), ("probe", 1, "dcat1")]
    (thread_name,) = _of_kind(events, "thread_name")
    assert (thread_name["os_thread_id"], thread_name["name"]) == (123, "worker")
    (se,) = start_end_ranges(events)
    assert se["message"] == "se"
    assert [e["domain"] for e in _of_kind(events, "domain_destroy")] == ["probe"]


def test_read_events_ignores_truncated_tail(tmp_path: Path) -> None:
    record = tmp_path / "partial.jsonl"
    record.write_text('{"seq":1,"kind":"mark"}\n{"seq":2,"ki')
    assert read_events(record) == [{"seq": 1, "kind": "mark"}]
    assert read_events(tmp_path / "missing.jsonl") == []
