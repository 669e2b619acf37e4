"""perfsdk._fastpath, the optional compiled hot path, and the switch that ignores it.

What the compiled NVTX range records is checked through the NVTX injection library in
tests/integration/test_nvtx_fastpath.py (against the pure-Python path); here: calling
conventions, exceptions, references, and that perfsdk imports and works without the module.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest

import perfsdk
from perfsdk import markers
from perfsdk.config import extensions_enabled

try:
    from perfsdk import _fastpath
except ImportError:
    _fastpath = None  # type: ignore[assignment]

needs_nvtx_call = pytest.mark.skipif(
    _fastpath is None or not _fastpath.HAVE_NVTX, reason="perfsdk._fastpath not built with NVTX")


@pytest.fixture
def nvtx_call() -> Any:
    # No tool is attached in this process: the range calls are NVTX's no-ops, the rest is real.
    return _fastpath.NvtxCall("perfsdk.test", "unit", 0xFF00FF00, 0, 7)


@needs_nvtx_call
def test_call_passes_arguments_and_result(nvtx_call: Any) -> None:
    assert nvtx_call(max, (1, 5, 2), {}) == 5
    assert nvtx_call(max, (1, 5, 2), None) == 5
    assert nvtx_call(sorted, ([3, 1, 2],), {"reverse": True}) == [3, 2, 1]
    assert nvtx_call(dict, (), {"a": 1}) == {"a": 1}
    assert repr(nvtx_call) == "<perfsdk._fastpath.NvtxCall 'perfsdk.test/unit'>"


@needs_nvtx_call
def test_call_raises_the_same_exception(nvtx_call: Any) -> None:
    error = KeyError("k")

    def boom() -> None:
        raise error

    with pytest.raises(KeyError) as info:
        nvtx_call(boom, (), {})
    assert info.value is error
    with pytest.raises(SystemExit):
        nvtx_call(sys.exit, (3,), {})


@needs_nvtx_call
def test_call_keeps_no_references(nvtx_call: Any) -> None:
    arg, result = object(), object()

    def fn(x: object) -> object:
        return result

    before = sys.getrefcount(arg), sys.getrefcount(result), sys.getrefcount(fn)
    for _ in range(100):
        nvtx_call(fn, (arg,), {})
    assert (sys.getrefcount(arg), sys.getrefcount(result), sys.getrefcount(fn)) == before


@needs_nvtx_call
@pytest.mark.parametrize(("args", "kwargs"), [
    ((), {}), ((len,), {}), ((len, [1]), {}), ((len, ([1],), {}, None), {}),
    ((len, ([1],), {}), {"extra": 1}),
])
def test_call_needs_fn_args_kwargs(nvtx_call: Any, args: tuple[Any, ...],
                                   kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match=r"fn, args, kwargs|tuple|dict"):
        nvtx_call(*args, **kwargs)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        nvtx_call(len, ([1],), [("a", 1)])


@needs_nvtx_call
@pytest.mark.parametrize("bad", [
    {"color": -1}, {"color": 2**32}, {"payload": 2**63}, {"payload": "x"}, {"category": -1},
])
def test_constructor_rejects_bad_values(bad: dict[str, Any]) -> None:
    options: dict[str, Any] = {"domain": "d", "message": "m", "color": 0xFF000000, **bad}
    with pytest.raises((OverflowError, TypeError, ValueError)):
        _fastpath.NvtxCall(**options)


@pytest.mark.skipif(_fastpath is None, reason="perfsdk._fastpath is not built")
def test_maxrss_is_a_byte_count() -> None:
    assert _fastpath.maxrss() > 1024 * 1024


def test_no_tool_no_compiled_range() -> None:
    """Without a tool the nvtx package hands out a dummy domain: no compiled range either, and
    NVTX-only mode takes the inline path (whose push and pop are the dummy's no-ops)."""
    marker = markers.NvtxMarker("perfsdk", "no.tool", 0xFF000000, None, None)
    assert marker.call is None
    perfsdk.configure(timing=False)

    @perfsdk.profiled("no.tool")
    def double(x: int, *, k: int = 2) -> int:
        return x * k

    assert double(3) == 6
    assert double(3, k=3) == 9


@pytest.mark.parametrize(("raw", "enabled"), [
    (None, True), ("", True), ("0", True), ("off", True), ("1", False), (" TRUE ", False),
])
def test_extensions_enabled(raw: str | None, enabled: bool) -> None:
    env = {} if raw is None else {"PERFSDK_DISABLE_EXTENSIONS": raw}
    assert extensions_enabled(env) is enabled


def test_a_bad_value_warns_and_keeps_the_extension() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extensions_enabled({"PERFSDK_DISABLE_EXTENSIONS": "maybe"}) is True
    assert any("PERFSDK_DISABLE_EXTENSIONS" in str(w.message) for w in caught)


@pytest.mark.parametrize("how", ["disabled", "missing"])
def test_perfsdk_works_without_the_extension(how: str) -> None:
    """PERFSDK_DISABLE_EXTENSIONS=1, or no compiled module at all (import blocked): the
    pure-Python paths, the same results."""
    script = textwrap.dedent("""
        import sys
        if sys.argv[1] == "missing":
            class Block:
                def find_spec(self, name, path=None, target=None):
                    if name == "perfsdk._fastpath":
                        raise ImportError("blocked")
                    return None
            sys.meta_path.insert(0, Block())
        import perfsdk
        from perfsdk import markers, memory
        assert not markers.compiled_nvtx()
        assert memory.peak_rss is memory._peak_rss_python
        perfsdk.configure(timing=False, exporter="none")

        @perfsdk.profiled
        def f(x):
            return x + 1

        assert f(1) == 2
        perfsdk.configure(timing=True)
        with perfsdk.timed_region("r", memory=True) as r:
            pass
        assert r.result().memory["perfsdk.memory.rss_peak_bytes"] > 0
        print("ok")
    """)
    env = {"PERFSDK_DISABLE_EXTENSIONS": "1"} if how == "disabled" else {}
    import os

    proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
