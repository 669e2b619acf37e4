"""``python -m perfsdk.cli``: the ``perfsdk`` command, as ``python -m perfsdk``."""

from perfsdk.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
