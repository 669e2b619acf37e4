"""Backward regions of :func:`perfsdk.auto.instrument_module`, from autograd node hooks.

A module's backward is the part of the autograd graph its forward call built: the nodes
reachable from its outputs' ``grad_fn`` that stop at its inputs' ``grad_fn`` (taken before the
forward ran, so in-place operations on an input count as the module's) and at parameters
(``AccumulateGrad``). The region starts when autograd is about to run one of the output nodes
(a node pre-hook) and ends when every *frontier* node, one whose inputs lead only outside the
module, has run (node post-hooks). So the region holds the module's whole backward, weight
gradients included, also for a first layer whose input does not require grad.

Why not ``register_full_backward_hook``: it wraps the module's inputs and outputs in a custom
autograd function, which makes an in-place operation on the output (``nn.ReLU(inplace=True)``
after a convolution) an error, and for a module whose inputs do not require grad torch calls it
as soon as the output gradients are known, before the module's backward ran. Node hooks change
no tensor.

Backward regions nest in a per-thread stack. Should autograd finish them out of order (parallel
branches), a finished region waits for the ones above it, so NVTX ranges and span contexts stay
balanced. Regions whose frontier never ran (an output that received no gradient) close when the
backward pass ends (an autograd engine callback); regions left open by a backward that raised
close at the instrumented model's next forward call.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from perfsdk.region import NULL_REGION, RegionSpec

__all__ = ["close_stale", "forward_done", "input_nodes", "track"]

_MAX_NODES = 20_000
"""A module whose backward graph is larger than this gets no backward region (bounded cost)."""

_tls = threading.local()
_task_id = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def _tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors in ``obj`` and in its tuples, lists and dict values (three levels deep)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for item in obj:
                _tensors(item, out, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                _tensors(item, out, depth + 1)
    return out


def input_nodes(args: Any, kwargs: Any) -> set[Any]:
    """The ``grad_fn`` of every input tensor, before the module runs: where its graph stops."""
    return {t.grad_fn for t in _tensors((args, kwargs), []) if t.grad_fn is not None}


def _stack() -> list[list[Any]]:
    try:
        stack: list[list[Any]] = _tls.stack
    except AttributeError:
        stack = _tls.stack = []
    return stack


def _unwind(stack: list[list[Any]]) -> None:
    """Exit the finished regions at the top of the stack (innermost first)."""
    while stack and stack[-1][1]:
        region = stack.pop()[0]
        region.exit(None)


class _Call:
    """One forward call's backward: started by any output node, ended by all frontier nodes."""

    __slots__ = ("entry", "frontier", "left", "spec")

    def __init__(self, spec: RegionSpec, frontier: int) -> None:
        self.spec = spec
        self.frontier = self.left = frontier
        self.entry: list[Any] | None = None

    def start(self, grad_outputs: Any) -> None:
        if self.entry is not None:
            return
        region = self.spec.open()  # the spec has every=1: the forward call was the sample
        if region is NULL_REGION:
            return
        task = _task_id()
        if getattr(_tls, "task", None) != task:  # first backward region of this pass here
            _tls.task = task
            _queue_callback(_end_of_pass)
        self.entry = [region, False, task]
        _stack().append(self.entry)

    def end(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.left -= 1
        if self.left > 0:
            return
        self.left = self.frontier  # a retained graph may run backward again
        entry, self.entry = self.entry, None
        if entry is not None:
            entry[1] = True
            _unwind(_stack())


class _Starts:
    """The pre-hook of one output node shared by several modules (a model's last layer and the
    model): the outer module, hooked last, starts first, so the regions nest."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def __call__(self, grad_outputs: Any) -> None:
        for call in self.calls:
            call.start(grad_outputs)


def _pending() -> dict[Any, _Starts]:
    try:
        pending: dict[Any, _Starts] = _tls.pending
    except AttributeError:
        pending = _tls.pending = {}
    return pending


def forward_done() -> None:
    """The outermost instrumented forward call on this thread returned: forget its nodes."""
    pending = getattr(_tls, "pending", None)
    if pending:
        pending.clear()


def _end_of_pass() -> None:
    """The backward pass is over: close its regions still open on this thread."""
    _tls.task = None
    stack = _stack()
    task = _task_id()
    for entry in stack:
        if entry[2] == task:
            entry[1] = True
    _unwind(stack)


def close_stale() -> None:
    """Close backward regions left open on this thread by a backward pass that raised."""
    if _task_id() != -1:  # inside a backward pass (checkpointing recomputes forward there)
        return
    stack = getattr(_tls, "stack", None)
    if stack:
        _tls.task = None
        for entry in stack:
            entry[1] = True
        _unwind(stack)


def _is_leaf_node(node: Any) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def track(spec: RegionSpec, boundary: set[Any], output: Any) -> bool:
    """Hook the backward of one forward call; False when it has none (or it is too large)."""
    starts = []
    for t in _tensors(output, []):
        node = t.grad_fn
        if node is not None and node not in boundary and node not in starts:
            starts.append(node)
    if not starts:
        return False
    seen: set[Any] = set()
    frontier = []
    todo = list(starts)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _MAX_NODES:
            return False
        inner = False
        for nxt, _ in node.next_functions:
            if nxt is None or nxt in boundary or _is_leaf_node(nxt):
                continue
            inner = True
            if nxt not in seen:
                todo.append(nxt)
        if not inner:
            frontier.append(node)
    call = _Call(spec, len(frontier))
    pending = _pending()
    for node in starts:
        shared = pending.get(node)
        if shared is None:
            shared = pending[node] = _Starts()
            node.register_prehook(shared)
        shared.calls.insert(0, call)
    for node in frontier:
        node.register_hook(call.end)
    return True
