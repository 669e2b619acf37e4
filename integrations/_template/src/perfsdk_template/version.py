"""The perfsdk-template version."""

__version__ = "0.1.0"
