"""What this integration instruments: checked at run time (by :func:`perfsdk.instrument_all`
before it imports this package, and by :class:`~perfsdk_lightning.LightningInstrumentor`)."""

instruments = ("lightning >= 2.2",)
_instruments = instruments  # opentelemetry-instrumentation's name for it
