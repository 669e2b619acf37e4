"""The framework this integration instruments, checked at runtime before it is used."""

_instruments = ("transformers >= 4.46",)
