"""The version of perfsdk-transformers."""

__version__ = "0.1.0"
