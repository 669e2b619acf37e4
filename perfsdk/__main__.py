"""``python -m perfsdk``: the ``perfsdk`` command (see :mod:`perfsdk.cli`)."""

from perfsdk.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
