"""The integration contract: what a framework integration (``perfsdk-lightning``,
``perfsdk-transformers``, the next one copied from ``integrations/_template``) builds on.

Modelled on opentelemetry-instrumentation's ``BaseInstrumentor`` and its dependency check:

- :class:`Instrumentor`: one instance per class; :meth:`~Instrumentor.instrument` and
  :meth:`~Instrumentor.uninstrument` are idempotent (a second call logs and does nothing); the
  framework requirements (the integration's ``instruments``, e.g. ``"lightning >= 2.2"``) are
  checked at run time, and a missing or too old framework is skipped with the reason, never
  raised into the program unless asked for (``raise_on_missing=True``). An integration states
  only what differs: its ``instruments``, its ``distribution`` and the :class:`InitPatch` es
  that instrumenting installs (``_patches``).
- :func:`instrument_all`: reads the ``perfsdk_integrations`` entry points that the integrations'
  ``pyproject.toml`` declare, and instruments every one whose framework is installed.
- :class:`InitPatch`: runs a function after each construction of a framework class (give every
  ``Trainer`` a callback), patching the class only once its module is imported.
- :data:`FRAMEWORK_STEPS`: an integration's callback says there when the framework's loop
  draws the training steps, and ``perfsdk run``'s own step, backward and optimizer regions step
  aside meanwhile.
- :class:`RunReport`: the regions of one training run, then perfsdk's summary of them and the
  advisor's findings (what the callbacks print when training ends).

Example:
    >>> import argparse
    >>> from perfsdk.instrumentor import InitPatch, Instrumentor
    >>> made = []
    >>> class Demo(Instrumentor):
    ...     instruments = ("torch >= 2.2",)
    ...     def _patches(self, **kwargs):
    ...         return [InitPatch("argparse", "ArgumentParser", made.append)]
    >>> Demo() is Demo(), Demo().instrument(), Demo().instrument(), Demo().is_instrumented
    (True, True, False, True)
    >>> parser = argparse.ArgumentParser(prog="demo")
    >>> Demo().uninstrument(), [p.prog for p in made]
    (True, ['demo'])
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as metadata
import logging
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

from typing_extensions import Self

from perfsdk.errors import warn_once

if TYPE_CHECKING:
    from perfsdk.advisor import Advice
    from perfsdk.record import RegionResult

__all__ = ["ENTRY_POINT_GROUP", "FRAMEWORK_STEPS", "DependencyConflict", "FrameworkSteps",
           "InitPatch", "InstrumentResult", "Instrumentor", "RunReport", "check_dependencies",
           "instrument_all"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "perfsdk_integrations"
"""The entry-point group :func:`instrument_all` reads; each entry names an :class:`Instrumentor`
subclass (``lightning = "perfsdk_lightning:LightningInstrumentor"``), or a module that defines
exactly one."""

_lock = threading.RLock()


# -- the dependency check ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DependencyConflict:
    """A requirement that is not met: ``found`` is the installed version, None when the
    distribution is not installed at all."""

    required: str
    found: str | None

    def __str__(self) -> str:
        if self.found is None:
            return f"{self.required!r} is required, but it is not installed"
        return f"{self.required!r} is required, but version {self.found} is installed"


_SIMPLE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*?)\s*$")
_CLAUSE = re.compile(r"^(==|!=|>=|<=|>|<|~=)\s*([0-9][0-9.]*)")


def _release(version: str) -> tuple[int, ...]:
    parts = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in parts.group(0).split(".")) if parts else ()


def _simple_contains(spec: str, version: str) -> bool:
    """``version`` meets ``spec`` (``">= 2.2, < 3"``): release numbers only, for when the
    ``packaging`` distribution is not installed."""
    have = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"cannot read the version clause {clause!r}")
        op, want_text = match.groups()
        want = _release(want_text)
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        ok = {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b,
              "~=": a >= b and a[:len(want) - 1] == b[:len(want) - 1]}[op]
        if not ok:
            return False
    return True


def _name_and_check(requirement: str) -> tuple[str, Callable[[str], bool]]:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging is not a dependency of perfsdk: a small reader instead
        match = _SIMPLE.match(requirement.split(";")[0])
        if match is None:
            raise ValueError(f"cannot read the requirement {requirement!r}") from None
        name, spec = match.groups()
        return name, functools.partial(_simple_contains, spec)
    req = Requirement(requirement)
    return req.name, functools.partial(req.specifier.contains, prereleases=True)


def check_dependencies(requirements: Collection[str]) -> DependencyConflict | None:
    """The first of ``requirements`` (``"lightning >= 2.2"``) that the installed distributions
    do not meet, or None when all are met. Reads installed metadata only: imports nothing.

    Example:
        >>> check_dependencies(["torch >= 2.2"]) is None
        True
        >>> str(check_dependencies(["no-such-distribution >= 1"]))
        "'no-such-distribution >= 1' is required, but it is not installed"
    """
    for requirement in requirements:
        name, contains = _name_and_check(requirement)
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return DependencyConflict(requirement, None)
        if not contains(version):
            return DependencyConflict(requirement, version)
    return None


# -- the instrumentor ---------------------------------------------------------------------
class Instrumentor:
    """The base of every integration: one instance per subclass (``LightningInstrumentor()``
    always returns the same object), idempotent :meth:`instrument` / :meth:`uninstrument`, and
    the framework requirements checked before instrumenting.

    A subclass states what differs: :attr:`instruments`, :attr:`distribution` and
    :meth:`_patches`, the :class:`InitPatch` es that :meth:`instrument` installs and
    :meth:`uninstrument` removes. One that needs more than class patches overrides
    :meth:`_instrument` and :meth:`_uninstrument` instead. Each of these takes the keyword
    arguments given to :meth:`instrument` / :meth:`uninstrument` (or to :func:`instrument_all`)
    and ignores those it does not know.
    """

    instruments: ClassVar[Collection[str]] = ()
    """The framework requirements, e.g. ``("lightning >= 2.2",)``: the integration's
    ``package.instruments``, the same as its ``pyproject.toml``'s ``instruments`` extra."""
    distribution: ClassVar[str | None] = None
    """The integration's own distribution (``"perfsdk-lightning"``), for the install hint."""
    _instances: ClassVar[dict[type[Instrumentor], Instrumentor]] = {}
    _is_instrumented: bool
    _installed: list[InitPatch]

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        if cls is Instrumentor:
            raise TypeError("Instrumentor is the base of an integration's instrumentor: "
                            "subclass it")
        with _lock:
            instance = Instrumentor._instances.get(cls)
            if instance is None:
                instance = super().__new__(cls)
                instance._is_instrumented = False
                instance._installed = []
                Instrumentor._instances[cls] = instance
            return instance  # type: ignore[return-value]

    def instrumentation_dependencies(self) -> Collection[str]:
        """The framework requirements checked before instrumenting: :attr:`instruments`."""
        return self.instruments

    def _patches(self, **kwargs: Any) -> Iterable[InitPatch]:
        """The class patches that instrument the framework (none here): read the options in
        ``kwargs`` (a bad value raises ValueError), patch nothing yet. An ImportError means the
        framework cannot be imported (skipped)."""
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        """Instrument the framework: install :meth:`_patches`. An ImportError means it cannot
        be imported (skipped)."""
        self._installed = list(self._patches(**kwargs))
        try:
            for patch in self._installed:
                patch.install()
        except BaseException:
            self._uninstrument()  # none left half done
            raise

    def _uninstrument(self, **kwargs: Any) -> None:
        """Undo :meth:`_instrument`: remove the patches it installed, the last first."""
        patches, self._installed = self._installed, []
        for patch in reversed(patches):
            patch.remove()

    @property
    def is_instrumented(self) -> bool:
        """Whether :meth:`instrument` is in effect."""
        return self._is_instrumented

    def dependency_conflict(self) -> DependencyConflict | None:
        """The first framework requirement that is not met, or None."""
        return check_dependencies(self.instrumentation_dependencies())

    def instrument(self, *, skip_dep_check: bool = False, raise_on_missing: bool = False,
                   **kwargs: Any) -> bool:
        """Instrument the framework, passing ``kwargs`` to :meth:`_instrument`; True if this
        call did. Already instrumented: logs and does nothing (False). The framework missing
        or too old: warns once and does nothing (False), or with ``raise_on_missing`` raises
        ImportError naming the requirement and the pip command. ``skip_dep_check`` skips the
        version check (the import may still fail)."""
        reason = self._try_instrument(skip_dep_check, kwargs)
        if reason is None:
            return True
        if self._is_instrumented:  # already: logged
            return False
        if raise_on_missing:
            raise ImportError(reason)
        warn_once(f"instrumentor:{type(self).__qualname__}", reason)
        return False

    def uninstrument(self, **kwargs: Any) -> bool:
        """Undo :meth:`instrument`, passing ``kwargs`` to :meth:`_uninstrument`; True if this
        call did. Not instrumented: logs and does nothing (False)."""
        with _lock:
            if not self._is_instrumented:
                logger.warning("%s: not instrumented, nothing to undo", type(self).__qualname__)
                return False
            self._uninstrument(**kwargs)
            self._is_instrumented = False
            return True

    def _try_instrument(self, skip_dep_check: bool, kwargs: dict[str, Any]) -> str | None:
        """Instrument; None when it did, else why not."""
        name = type(self).__qualname__
        with _lock:
            if self._is_instrumented:
                logger.warning("%s: already instrumented", name)
                return "already instrumented"
            conflict = None if skip_dep_check else self.dependency_conflict()
            if conflict is None:
                try:
                    self._instrument(**kwargs)
                except ImportError as exc:
                    problem = f"the framework cannot be imported ({exc})"
                else:
                    self._is_instrumented = True
                    return None
            else:
                problem = str(conflict)
        hint = f"pip install '{self.distribution}[instruments]'" if self.distribution else \
            "install the framework"
        return f"perfsdk: {name} not instrumented: {problem}. To use it: {hint}"


# -- discovery ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InstrumentResult:
    """What :func:`instrument_all` did with one entry point: ``instrumented`` is True when it
    instrumented the framework now, else ``reason`` says why not (not installed, too old,
    already instrumented, failed)."""

    name: str
    instrumented: bool
    reason: str = ""
    instrumentor: Instrumentor | None = None


def _dist_instruments(entry_point: metadata.EntryPoint) -> list[str]:
    """The ``instruments`` extra of the distribution that declares ``entry_point``."""
    dist = getattr(entry_point, "dist", None)
    found = []
    for line in (dist.requires or []) if dist is not None else []:
        requirement, _, marker = line.partition(";")
        if re.search(r"""extra\s*==\s*["']instruments["']""", marker):
            found.append(requirement.strip())
    return found


def _instrumentor_of(loaded: Any) -> Instrumentor:
    if isinstance(loaded, Instrumentor):
        return loaded
    if isinstance(loaded, type) and issubclass(loaded, Instrumentor):
        return loaded()
    if isinstance(loaded, types.ModuleType):  # an entry point naming the integration's module
        classes = {v for v in vars(loaded).values() if isinstance(v, type)
                   and issubclass(v, Instrumentor) and v is not Instrumentor}
        if len(classes) == 1:
            return classes.pop()()
    raise TypeError(f"{loaded!r} is not an Instrumentor subclass, nor a module defining one")


def instrument_all(**kwargs: Any) -> list[InstrumentResult]:
    """Instrument every installed integration whose framework is installed: reads the
    ``perfsdk_integrations`` entry points, checks each one's ``instruments`` requirements before
    importing it, then calls its :meth:`Instrumentor.instrument` with ``kwargs`` (e.g.
    ``report=False``). Never raises: whatever is skipped or fails is in the result, with the
    reason (and logged).

    Example:
        >>> import perfsdk
        >>> results = perfsdk.instrument_all(report=False)
        >>> all(r.instrumented or r.reason for r in results)
        True
        >>> for r in results:
        ...     if r.instrumented:
        ...         _ = r.instrumentor.uninstrument()
    """
    results: list[InstrumentResult] = []
    seen: set[str] = set()
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        name = entry_point.name
        if name in seen:  # the same integration found twice on sys.path
            continue
        seen.add(name)
        conflict = check_dependencies(_dist_instruments(entry_point))
        if conflict is not None:  # OTel's order: the framework before the import
            results.append(InstrumentResult(name, False, str(conflict)))
            logger.info("perfsdk: integration %r skipped: %s", name, conflict)
            continue
        instrumentor = None
        try:
            instrumentor = _instrumentor_of(entry_point.load())
            reason = instrumentor._try_instrument(False, kwargs)
        except Exception as exc:  # one broken integration never stops the others
            reason = f"failed: {exc!r}"
            warn_once(f"instrument_all:{name}",
                      f"perfsdk: integration {name!r} could not be instrumented ({exc!r})")
        results.append(InstrumentResult(name, reason is None, reason or "", instrumentor))
        if reason is not None:
            logger.info("perfsdk: integration %r: %s", name, reason)
    return results


# -- helpers for integrations ---------------------------------------------------------------
class InitPatch:
    """Run ``hook(instance)`` after every construction of the class ``module.name`` (give every
    ``Trainer`` a callback), from :meth:`install` to :meth:`remove`.

    The class is patched only once its module is imported (at once when it already is; a
    post-import hook otherwise), so instrumenting never imports the framework. The hook's
    failure warns once and never breaks the construction.

    Example:
        >>> import argparse
        >>> made = []
        >>> patch = InitPatch("argparse", "ArgumentParser", made.append)
        >>> patch.install()
        >>> first = argparse.ArgumentParser(prog="first")
        >>> patch.remove()
        >>> second = argparse.ArgumentParser(prog="second")
        >>> [parser.prog for parser in made]
        ['first']
    """

    def __init__(self, module: str, name: str, hook: Callable[[Any], None]) -> None:
        self.module = module
        self.name = name
        self.hook = hook
        self._active = False
        self._registered = False
        self._undo: tuple[type, Any] | None = None

    def install(self) -> None:
        with _lock:
            self._active = True
            module = sys.modules.get(self.module)
            if module is not None:
                self._patch(module)
            elif not self._registered:
                import wrapt

                wrapt.register_post_import_hook(self._patch, self.module)
                self._registered = True

    def remove(self) -> None:
        with _lock:
            self._active = False
            undo, self._undo = self._undo, None
            if undo is not None:
                cls, original = undo
                if original is None:
                    del cls.__init__  # type: ignore[misc]
                else:
                    cls.__init__ = original  # type: ignore[misc]

    def _patch(self, module: Any) -> None:
        with _lock:
            if not self._active or self._undo is not None:
                return
            cls = getattr(module, self.name)
            original = cls.__dict__.get("__init__")
            init = cls.__init__
            hook, label = self.hook, f"{self.module}.{self.name}"

            @functools.wraps(init)
            def __init__(instance: Any, *args: Any, **kwargs: Any) -> None:
                init(instance, *args, **kwargs)
                try:
                    hook(instance)
                except Exception as exc:
                    warn_once(f"InitPatch:{label}:{type(exc).__name__}",
                              f"perfsdk: instrumenting a new {label} failed ({exc!r}); it "
                              "works without")

            cls.__init__ = __init__
            self._undo = (cls, original)


class FrameworkSteps:
    """Whether a framework's loop draws the training steps now (:data:`FRAMEWORK_STEPS`).

    An integration's callback calls :meth:`begin` when the framework's run starts (Lightning's
    ``setup``, the Hugging Face Trainer's ``on_train_begin``) and :meth:`end` when it ends or
    fails. Meanwhile :attr:`active` is True and ``perfsdk run``'s own patches step aside: no
    ``step`` at each DataLoader batch, no ``backward`` or ``optimizer`` region (the callback's
    regions time those), so that each step's phases are counted once. Lightning's
    ``optimizer.step()`` call, for one, holds the whole closure (forward and backward): timed as
    well, it would count the optimizer twice. The model's forward call and the ``data_wait``
    regions stay: no callback times those.

    Process-wide, as :data:`perfsdk.auto.STEPS` is. Each owner counts once; one that is garbage
    collected without :meth:`end` (a run that raised, and its trainer dropped) ends then.
    Modelled on opentelemetry-instrumentation's ``suppress_instrumentation``, by which a
    higher-level instrumentation keeps a lower one from recording the same operation.

    Example:
        >>> from perfsdk.instrumentor import FRAMEWORK_STEPS
        >>> class Callback:  # a framework callback
        ...     def on_train_begin(self):
        ...         FRAMEWORK_STEPS.begin(self)
        ...     def on_train_end(self):
        ...         FRAMEWORK_STEPS.end(self)
        >>> callback = Callback()
        >>> callback.on_train_begin(); FRAMEWORK_STEPS.active
        True
        >>> callback.on_train_end(); FRAMEWORK_STEPS.active
        False
    """

    __slots__ = ("_owners", "active")

    def __init__(self) -> None:
        self.active = False
        """Whether some owner has begun and not ended: one attribute read on the hot path."""
        self._owners: dict[int, Callable[[], object | None]] = {}

    def begin(self, owner: object) -> None:
        """``owner`` (a callback) draws the steps from now on, until :meth:`end`."""
        key = id(owner)
        with _lock:
            known = self._owners.get(key)
            if known is None or known() is not owner:
                ref: Callable[[], object | None]
                try:
                    ref = weakref.ref(owner, functools.partial(self._gone, key))
                except TypeError:  # no weak reference to it: kept until end()
                    ref = functools.partial(_same, owner)
                self._owners[key] = ref
            self.active = True

    def end(self, owner: object) -> None:
        """``owner`` draws no steps any more; idempotent."""
        with _lock:
            known = self._owners.get(id(owner))
            if known is not None and known() is owner:
                del self._owners[id(owner)]
            self.active = bool(self._owners)

    def _gone(self, key: int, ref: object) -> None:
        with _lock:
            if self._owners.get(key) is ref:
                del self._owners[key]
            self.active = bool(self._owners)


def _same(owner: object) -> object:
    return owner


FRAMEWORK_STEPS = FrameworkSteps()
"""Set while a framework integration's callback draws the training steps: ``perfsdk run``'s
patches read :attr:`FrameworkSteps.active` and step aside."""


class RunReport:
    """The regions of one training run, from :meth:`start` to :meth:`finish`, which prints
    perfsdk's summary of them and the advisor's findings (``perfsdk run``'s report, for one
    run inside a process).

    Example:
        >>> import io, perfsdk
        >>> report, out = RunReport(), io.StringIO()
        >>> report.start()
        >>> with perfsdk.timed_region("work"):
        ...     pass
        >>> perfsdk.flush()
        >>> advice = report.finish(lambda regions, s: f"{len(regions)} region", out=out)
        >>> "1 region" in out.getvalue() and not report.recording
        True
    """

    def __init__(self) -> None:
        self._recorder: Any = None
        self._started = 0.0

    @property
    def recording(self) -> bool:
        """Whether :meth:`start` was called and neither :meth:`stop` nor :meth:`finish` since."""
        return self._recorder is not None

    def start(self) -> None:
        """Start recording (a recording already running is dropped, with no report)."""
        from perfsdk.cli.runfile import RunRecorder  # the cli's recorder: no torch at import

        self.stop()
        self._recorder = RunRecorder().__enter__()
        self._started = time.perf_counter()

    def stop(self) -> None:
        """Stop recording, printing nothing (e.g. the run raised); idempotent."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)

    def finish(self, title: Callable[[Sequence[RegionResult], float], str], *,
               out: TextIO | None = None) -> Advice | None:
        """Stop recording and write ``title(regions, seconds)``, the summary of the run's
        regions and the advisor's findings to ``out`` (stdout); returns the advice, or None
        when nothing was recording."""
        from perfsdk.cli.run import print_report

        recorder = self._recorder
        if recorder is None:
            return None
        self.stop()
        seconds = time.perf_counter() - self._started
        return print_report(recorder, out or sys.stdout, title=title(recorder.regions, seconds))
