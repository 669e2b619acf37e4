"""Pytest fixtures for the NVTX recording injection library.

Import into a test module with::

    from tests.nvtx_injection.fixtures import nvtx_lib  # noqa: F401
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nvtx_injection.recorder import build_library


@pytest.fixture(scope="session")
def nvtx_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the built ``librecorder.so``; skips the test if it cannot be built."""
    out_dir = tmp_path_factory.mktemp("nvtx_injection")
    try:
        return build_library(out_dir)
    except RuntimeError as exc:
        pytest.skip(f"NVTX recorder library unavailable: {exc}")
