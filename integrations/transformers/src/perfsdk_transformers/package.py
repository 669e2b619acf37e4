"""The framework this integration instruments, checked at run time before it is used (by
:func:`perfsdk.instrument_all` and by :class:`~perfsdk_transformers.TransformersInstrumentor`)."""

instruments = ("transformers >= 4.44",)
_instruments = instruments  # opentelemetry-instrumentation's name for it
