"""``import perfsdk`` reaches every public sub-package by attribute, lazily: the lines the
advisor and the docs print (``perfsdk.optimize.tune_dataloader(...)``) run after a plain
``import perfsdk``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SUBPACKAGES = ("optimize", "bench", "testing", "auto", "distributed")


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_subpackage_reachable_after_a_plain_import(name: str) -> None:
    script = textwrap.dedent(f"""
        import sys
        import perfsdk
        assert "perfsdk.{name}" not in sys.modules or "{name}" == "auto", "imported up front"
        module = perfsdk.{name}
        assert module is sys.modules["perfsdk.{name}"], module
        assert "{name}" in dir(perfsdk)
        from perfsdk import {name} as again
        assert again is module
        print(sorted(module.__all__)[:1])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("['"), proc.stdout


def test_printed_fix_names_resolve() -> None:
    import perfsdk

    assert callable(perfsdk.optimize.tune_dataloader)
    assert callable(perfsdk.optimize.optimize)
    assert callable(perfsdk.bench.compare)
    assert callable(perfsdk.testing.capture)
    assert set(SUBPACKAGES) <= set(perfsdk.__all__)


def test_unknown_name_is_an_attribute_error() -> None:
    import perfsdk

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        perfsdk.nope  # noqa: B018
