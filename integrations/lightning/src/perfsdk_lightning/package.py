"""What this integration instruments: checked by perfsdk's integration loader before import."""

_instruments = ("lightning >= 2.2",)
