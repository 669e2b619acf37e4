"""perfsdk inside ``torch.compile``: no graph break, same results.

``fullgraph=True`` turns any graph break into an exception, and ``torch._dynamo.explain``
counts graphs and breaks, so both are used as the real consumer here. Most tests use the
``eager``/``aot_eager`` backends (Dynamo's tracing is what can break; they skip codegen); one
compiles with the default inductor backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from perfsdk import profiled, timed_region
from perfsdk.testing import capture


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@profiled("cc.inner")
def inner(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2


@profiled("cc.named", color="green", category="math", payload=3, attributes={"k": 1})
def named(x: torch.Tensor) -> torch.Tensor:
    return x.cos() + 1


def model_fn(x: torch.Tensor) -> torch.Tensor:
    return named(inner(x)) - x


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    @profiled("cc.forward")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inner(self.lin(x)).relu()


def _explain(fn: Any, *args: Any) -> Any:
    return torch._dynamo.explain(fn)(*args)


def test_explain_finds_one_graph_and_no_break() -> None:
    x = torch.randn(8)
    out = _explain(model_fn, x)
    assert (out.graph_count, out.graph_break_count) == (1, 0), out.break_reasons
    assert out.break_reasons == []


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_same_result(backend: str) -> None:
    x = torch.randn(8)
    compiled = torch.compile(model_fn, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), model_fn(x))
    torch.testing.assert_close(compiled(x + 1), model_fn(x + 1))


def test_compiling_the_decorated_function_itself() -> None:
    x = torch.randn(8)
    compiled = torch.compile(named, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), x.cos() + 1)
    out = _explain(named, x)
    assert (out.graph_count, out.graph_break_count) == (1, 0), out.break_reasons


def test_module_with_profiled_forward() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), block(x))
    # and backward through the compiled graph works
    compiled(x).sum().backward()
    assert block.lin.weight.grad is not None


# torch's own deprecation notice, raised while inductor sets itself up (not perfsdk's)
@pytest.mark.filterwarnings(r"ignore:.*torch\.jit\.script_method:DeprecationWarning")
def test_fullgraph_with_the_default_inductor_backend() -> None:
    x = torch.randn(16)
    compiled = torch.compile(model_fn, fullgraph=True)
    torch.testing.assert_close(compiled(x), model_fn(x))


def test_regions_still_recorded_outside_compiled_code() -> None:
    x = torch.randn(8)
    compiled = torch.compile(model_fn, fullgraph=True, backend="eager")
    compiled(x)
    with capture() as cap:
        expected = model_fn(x)  # eager: the wrappers are live again
        torch.testing.assert_close(compiled(x), expected)
    names = [r.name for r in cap.regions]
    assert names.count("cc.inner") >= 1
    assert names.count("cc.named") >= 1


# Dynamo's notice of an untraceable call; the graph break itself is what must not happen
_DYNAMO_NOTICE = "ignore:Dynamo does not know how to trace:UserWarning"


@pytest.mark.filterwarnings(_DYNAMO_NOTICE)
def test_timed_region_inside_compiled_function() -> None:
    """DESIGN rule 5: inside compiled code a region must not cause a graph break; this one
    uses ``with timed_region(...)`` rather than a decorator."""

    def body(x: torch.Tensor) -> torch.Tensor:
        with timed_region("cc.block", step=1):
            y = torch.cos(x)
        return y + 1

    x = torch.randn(8)
    compiled = torch.compile(body, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), torch.cos(x) + 1)


@pytest.mark.filterwarnings(_DYNAMO_NOTICE)
def test_timed_region_as_decorator_inside_compiled_function() -> None:
    @timed_region("cc.decorated")
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    def body(x: torch.Tensor) -> torch.Tensor:
        return step(x) + 1

    x = torch.randn(8)
    compiled = torch.compile(body, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), x * 3 + 1)


@pytest.mark.filterwarnings(_DYNAMO_NOTICE)
def test_steps_inside_compiled_function_do_not_break_the_graph() -> None:
    """DESIGN rule 5 for a step: ``with perfsdk.step()``, a plain ``perfsdk.step()`` call and
    ``Step.end()`` inside compiled code (where the step's start and end are compiled C, which
    dynamo cannot trace: their Python callers hand it the Python code, and a Step's ``with``
    methods are TwinMethods, whose ``__func__`` dynamo inlines)."""
    import perfsdk
    from perfsdk import auto

    def body(x: torch.Tensor) -> torch.Tensor:
        with perfsdk.step(samples=2):
            y = torch.cos(x)
        auto.STEPS.step().end()
        perfsdk.step()
        return y + 1

    x = torch.randn(8)
    compiled = torch.compile(body, fullgraph=True, backend="eager")
    try:
        torch.testing.assert_close(compiled(x), torch.cos(x) + 1)
    finally:
        auto.end_step()
    with capture() as cap:  # eager again: the steps are recorded
        body(x)
        auto.end_step()
    assert [r.name for r in cap.regions].count("step") == 3


@pytest.mark.filterwarnings(_DYNAMO_NOTICE)
def test_a_step_inside_compiled_code_steps_aside_without_recompiling() -> None:
    """DESIGN rule 5: the step's Python code read the steps' index counter, which dynamo
    guarded on, so every call recompiled until the limit (8) and then ran eagerly. Inside the
    compiled function a step now steps aside: one compilation for twelve calls, no index
    counted, nothing recorded; the steps around it count on."""
    import perfsdk
    from perfsdk import auto

    compilations: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        compilations.append(1)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def body(x: torch.Tensor) -> torch.Tensor:
        with perfsdk.step(samples=4) as s:
            y = torch.cos(x) + s.index  # the stepped-aside step: index -1
        return y

    x = torch.randn(8)
    with capture() as cap:
        with perfsdk.step():  # an eager step around the compiled calls
            first = auto.STEPS.next_index
            for _ in range(12):
                torch.testing.assert_close(body(x), torch.cos(x) - 1)
            assert auto.STEPS.next_index == first  # no index counted inside
        with perfsdk.step() as after:
            pass
    assert len(compilations) == 1
    steps = cap.named("step")
    assert len(steps) == 2  # the two eager steps only
    assert after.index == first
    with pytest.raises(ValueError, match="samples"):
        torch.compile(lambda t: perfsdk.step(samples=0) and t, backend="eager")(x)


@pytest.mark.filterwarnings(_DYNAMO_NOTICE)
@pytest.mark.parametrize("implementation", ["compiled", "python"])
def test_a_phase_inside_compiled_code_runs_eagerly(implementation: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase made outside a compiled function is a context manager dynamo does not enter,
    whichever ``with`` block it has (the compiled methods or the Python ones): the block is a
    graph break, runs eagerly and is recorded at every call, and ``fullgraph=True`` raises
    dynamo's own error (docs: phases go around compiled code)."""
    import perfsdk
    from perfsdk import phases

    if implementation == "python":
        for owner, name, twin in phases.python_twins():
            monkeypatch.setattr(owner, name, twin)
    forward = perfsdk.phase("cc.phase")

    def body(x: torch.Tensor) -> torch.Tensor:
        with forward:
            y = torch.cos(x)
        return y + 1

    x = torch.randn(8)
    compiled = torch.compile(body, backend="eager")
    with capture() as cap:
        for _ in range(2):
            with perfsdk.step():
                torch.testing.assert_close(compiled(x), torch.cos(x) + 1)
        perfsdk.flush()
    steps = cap.named("step")
    assert [r.parent_span_id for r in cap.named("cc.phase")] == [s.span_id for s in steps]
    assert forward._active == []
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(body, fullgraph=True, backend="eager")(x)
    assert forward._active == []
