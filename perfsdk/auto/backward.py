"""Backward regions of :func:`perfsdk.auto.instrument_module`, from autograd sequence numbers.

Every autograd node gets a sequence number when it is created, from a counter of the creating
thread (``torch.autograd._get_sequence_nr()`` reads the next one). A module call's own nodes are
those numbered from the counter read just before its ``forward`` runs (``first``) up to the
counter just after: the nodes its forward created, in-place operations on its inputs included,
and nothing created before it (its inputs' ``grad_fn``, parameters' ``AccumulateGrad``).

The engine runs the ready node with the highest sequence number first (``AccumulateGrad``
aside, which runs as soon as it is ready), and a node's gradient comes only from nodes created
after it, so on one ready queue the nodes run in decreasing order: a module call's nodes run as
one block, and once a node numbered below ``first`` starts, the call's backward is over. So:

- the region starts when autograd is about to run one of the call's output nodes (a node
  pre-hook);
- it ends when a hooked node numbered below ``first`` starts (the pre-hook of another
  instrumented call's output node, or of one of this call's inputs' ``grad_fn``), or when the
  backward pass ends (an autograd engine callback), as it does for a first layer whose input
  needs no grad: its weight gradients are inside the region.

No graph is walked and no tensor is wrapped: per forward call, one counter read and at most one
hook per node that is an instrumented call's output or input (nodes shared by nested modules
and by consecutive layers get one hook between them). An output node is hooked through its
tensor, as ``Tensor.register_hook`` does (the tensor's ``_backward_hooks`` dict, registered on
the node), without the ``RemovableHandle`` that costs most of a ``Node.register_prehook``. Why not
``register_full_backward_hook``: it wraps the module's inputs and outputs in a custom autograd
function, which makes an in-place operation on the output (``nn.ReLU(inplace=True)`` after a
convolution) an error, and for a module whose inputs do not require grad torch calls it as soon
as the output gradients are known, before the module's backward ran.

Backward regions nest in a per-thread stack (the thread autograd runs the nodes on) and only
its top is ever closed, so NVTX ranges and span contexts stay balanced. Regions whose end no
hook saw close when their backward pass ends (when autograd finishes the pass on another
thread, they end then and close at their own thread's next hook); regions left open by a
backward that raised close at the instrumented model's next forward call. Where the order
above does not hold (a graph whose nodes run on several devices' queues at once) a region can
end late or early, never unbalanced.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from perfsdk import region as _region
from perfsdk.errors import warn_once
from perfsdk.region import NULL_REGION, now_ns

__all__ = ["close_stale", "first_node", "forward_done", "input_nodes", "track"]

_task_id = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_Tensor = torch.Tensor
_partial = functools.partial
first_node: Any = torch._C._autograd._get_sequence_nr
"""The sequence number the next autograd node created on this thread gets."""

_DONE = -2
"""``TASK`` of an entry whose region is to close as soon as nothing above it is open."""
_NO_NODE = 2**64
"""Above every node's sequence number."""

# An entry: one forward call's backward region, a list so that its hot path allocates no
# object of ours. [OPEN (opens its region: the spec's open_inner, from region.inner_gate),
# FIRST, REGION (None while closed), TASK (the graph task it opened in,
# _DONE once finished), END (the host clock reading to end at when another thread finished
# it, else 0: now)]
OPEN, FIRST, REGION, TASK, END = range(5)


class _State(threading.local):
    def __init__(self) -> None:
        self.stack: list[list[Any]] = []
        """Open backward regions on this thread, innermost last."""
        self.nodes: dict[Any, list[list[Any]]] = {}
        """The nodes hooked during the current outermost forward call on this thread: node ->
        the entries it starts (outermost first)."""
        self.task: int | None = None
        """The graph task whose end-of-pass callback this thread has queued."""


_tls = _State()


def _tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors in ``obj`` and in its tuples, lists and dict values (three levels deep)."""
    if isinstance(obj, _Tensor):
        out.append(obj)
    elif depth < 3:
        if isinstance(obj, (tuple, list)):
            for item in obj:
                _tensors(item, out, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                _tensors(item, out, depth + 1)
    return out


def input_nodes(args: Any, kwargs: Any) -> list[Any]:
    """The ``grad_fn`` of the input tensors before the module runs (where its backward ends),
    None for those without one."""
    return [t.grad_fn for t in _tensors((args, kwargs), [])]


def _close_above(stack: list[list[Any]], seq: int) -> None:
    """Exit the regions at the top of the stack whose ``FIRST`` is above ``seq`` (and those
    already finished)."""
    while stack and (stack[-1][FIRST] > seq or stack[-1][TASK] == _DONE):
        entry = stack.pop()
        region, entry[REGION] = entry[REGION], None
        region.exit(None, entry[END])


def _on_node(seq: int, entries: list[list[Any]], grad_outputs: Any) -> None:
    """The pre-hook of a hooked node: close the calls all of whose nodes have run, then open
    the calls this node is an output of (outermost first)."""
    try:
        tls = _tls
        stack = tls.stack
        while stack and (stack[-1][FIRST] > seq or stack[-1][TASK] == _DONE):  # _close_above
            entry = stack.pop()
            region, entry[REGION] = entry[REGION], None
            region.exit(None, entry[END])
        for entry in entries:
            if entry[REGION] is not None:  # opened by another of its outputs
                continue
            task = _task_id()
            if tls.task != task:  # the first region this pass opens on this thread
                _queue_callback(_partial(_end_of_pass, stack))
                tls.task = task
            # every=1: the forward call was the sample; an InnerRegion when it nests in the
            # current Region (the outermost backward region open, usually)
            region = entry[OPEN]()
            if region is NULL_REGION:
                continue
            entry[REGION] = region
            entry[TASK] = task
            entry[END] = 0
            stack.append(entry)
    except Exception as exc:  # our bookkeeping must never break the user's backward
        _warn(exc)


_make_hook: Any = _partial(_partial, _on_node)
"""``_make_hook(seq, entries)``: a hooked node's pre-hook, ``_on_node(seq, entries, grad)``
when called; compiled (``perfsdk._fastpath.NodeHook``, the same code) where
:data:`perfsdk.region.inner_gate` is (bound at the end of this module)."""


def _warn(exc: Exception) -> None:
    warn_once(f"auto-backward:{type(exc).__name__}",
              f"perfsdk: a backward region of instrument_module failed: {exc!r}")


def _register(node: Any, nodes: dict[Any, list[list[Any]]]) -> list[list[Any]]:
    """Hook ``node`` (once per forward call on this thread); the list of entries it opens."""
    entries: list[list[Any]] = []
    nodes[node] = entries
    node.register_prehook(_make_hook(node._sequence_nr(), entries))
    return entries


_HOOK_KEY = "perfsdk.backward"
"""Our key in a tensor's ``_backward_hooks`` (torch's own keys are ints)."""


class _Hooks(dict):  # type: ignore[type-arg]
    """A tensor's ``_backward_hooks`` made by us: a dict that ``Tensor.register_hook``'s
    ``RemovableHandle`` can refer to weakly (torch makes an ``OrderedDict``, slower to build)."""

    __slots__ = ("__weakref__",)


def _register_output(tensor: torch.Tensor, node: Any, seq: int,
                     nodes: dict[Any, list[list[Any]]]) -> list[list[Any]]:
    """Hook ``node``, the ``grad_fn`` of ``tensor``: as :func:`_register`, but through the
    tensor, the way ``Tensor.register_hook`` does it without its ``RemovableHandle`` (a third
    of the cost; nothing here is ever removed: the hook goes with the graph). A tensor hook
    runs when the tensor's gradient is ready, just before ``node`` runs: when ``node``'s
    pre-hook would. A tensor that has hooks already (the user's), or of a subclass (whose
    ``register_hook`` may mean something else), gets a node pre-hook."""
    entries: list[list[Any]] = []
    nodes[node] = entries
    hook = _make_hook(seq, entries)
    if type(tensor) is _Tensor and tensor._backward_hooks is None:
        tensor._backward_hooks = _Hooks(((_HOOK_KEY, hook),))
        node._register_hook_dict(tensor)
    else:
        node.register_prehook(hook)
    return entries


def track(open_: Callable[[], Any], first: int, inputs: Any, output: Any) -> bool:
    """Hook the backward of one forward call, whose region ``open_()`` opens (the backward
    spec's gate, :data:`perfsdk.region.inner_gate`), for which ``first`` was read from
    :func:`first_node` before its forward ran, with the ``grad_fn`` of its inputs (one node or
    None for a single input tensor, else :func:`input_nodes`). False when the call created no
    autograd node that reaches its output."""
    nodes = _tls.nodes
    entry: list[Any] | None = None
    if isinstance(output, _Tensor):
        node = output.grad_fn
        if node is not None:
            seq = node._sequence_nr()
            if seq >= first:
                entry = [open_, first, None, None, 0]
                entries = nodes.get(node)
                if entries is None:  # _register_output, written out: one Python call less
                    # per module call (~1,500 instructions, callgrind; the 3x budget is tight)
                    entries = nodes[node] = [entry]
                    hook = _make_hook(seq, entries)
                    if type(output) is _Tensor and output._backward_hooks is None:
                        output._backward_hooks = _Hooks(((_HOOK_KEY, hook),))
                        node._register_hook_dict(output)
                    else:
                        node.register_prehook(hook)
                else:
                    entries.insert(0, entry)  # hooked last, the outermost call: it opens first
    else:
        seen = []
        for t in _tensors(output, []):
            node = t.grad_fn
            if node is None or node in seen:
                continue
            seq = node._sequence_nr()
            if seq >= first:
                seen.append(node)
                if entry is None:
                    entry = [open_, first, None, None, 0]
                entries = nodes.get(node)
                if entries is None:
                    entries = _register_output(t, node, seq, nodes)
                entries.insert(0, entry)
    if entry is None:
        return False
    if type(inputs) is list:
        for node in inputs:
            if node is not None and node not in nodes:
                _register(node, nodes)
    elif inputs is not None and inputs not in nodes:
        _register(inputs, nodes)
    return True


def forward_done() -> None:
    """The outermost instrumented forward call on this thread returned: forget its nodes."""
    nodes = _tls.nodes
    if nodes:
        _tls.nodes = {}


def _finish(stack: list[list[Any]], task: int | None) -> None:
    """Close this thread's regions of graph task ``task`` (all for None); one under a region
    still open closes with it."""
    for entry in stack:
        if task is None or entry[TASK] == task:
            entry[TASK] = _DONE
    _close_above(stack, _NO_NODE)


def _end_of_pass(stack: list[list[Any]]) -> None:
    """The backward pass is over: close its regions still open on the thread whose ``stack``
    this is. Autograd runs this on the thread that finished the pass; regions another thread
    opened are marked to end now and close at that thread's next hook (a region's context
    can only be detached on its own thread)."""
    try:
        task = _task_id()
        if stack is _tls.stack:
            _tls.task = None
            _finish(stack, task)
            return
        t1 = now_ns()
        for entry in stack:
            if entry[TASK] == task:
                entry[END] = t1
                entry[TASK] = _DONE
    except Exception as exc:  # as in _on_node
        _warn(exc)


def close_stale() -> None:
    """Close backward regions left open on this thread by a backward pass that raised."""
    try:
        if _task_id() != -1:  # inside a backward pass (checkpointing recomputes forward)
            return
        stack = _tls.stack
        if stack:
            _tls.task = None
            _finish(stack, None)
    except Exception as exc:  # as in _on_node
        _warn(exc)


track_python = track
"""The pure-Python :func:`track`."""

if _region._fastpath is not None and _region.inner_gate is _region._fastpath.InnerGate:
    # Compiled twins, the same code (perfsdk/_fastpath.c): the node hook, and track() for an
    # output that is a plain tensor (any other goes to track_python)
    _region._fastpath.bind_backward(globals())
    _make_hook = _region._fastpath.NodeHook
    track = _region._fastpath.track
