"""What this integration instruments, checked at run time (perfsdk.instrument_all reads the
same requirements from pyproject.toml's `instruments` extra before importing the package)."""

instruments = ("torch >= 2.2",)  # replace with your framework, e.g. ("lightning >= 2.2",)
_instruments = instruments  # opentelemetry-instrumentation's name for it
