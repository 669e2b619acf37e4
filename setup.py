"""Build the optional compiled modules, ``perfsdk._fastpath`` (the hot path) and
``perfsdk.export._spanbuild`` (spans on the export thread); the rest is in pyproject.toml.

The extensions are optional: without a C compiler, or when one fails to compile, the install
goes on and perfsdk uses its pure-Python paths (setuptools prints a warning). The hot path's
NVTX part needs the NVTX v3 headers (``nvtx3/nvToolsExt.h``): ``$NVTX_INCLUDE_DIR``, else the
include directory beside ``nvcc``, ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda`` or
``/usr/local/cuda-*``; without them the module is built without it.
``PERFSDK_BUILD_EXTENSIONS=0`` skips the build.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup

_HEADER = Path("nvtx3") / "nvToolsExt.h"


def nvtx_include() -> str | None:
    explicit = os.environ.get("NVTX_INCLUDE_DIR")
    candidates = [Path(explicit)] if explicit else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates += [Path(nvcc).parent.parent / "include",
                       Path(nvcc).resolve().parent.parent / "include"]
    candidates += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH")
                   if os.environ.get(v)]
    candidates.append(Path("/usr/local/cuda/include"))
    candidates += sorted(Path("/usr/local").glob("cuda-*/include"), reverse=True)
    for candidate in candidates:
        if (candidate / _HEADER).is_file():
            return str(candidate)
    return None


def extensions() -> list[Extension]:
    if os.environ.get("PERFSDK_BUILD_EXTENSIONS", "1").strip().lower() in ("0", "false", "no",
                                                                           "off"):
        return []
    if sys.implementation.name != "cpython":
        return []
    include = nvtx_include()
    spans = Extension("perfsdk.export._spanbuild", sources=["perfsdk/export/_spanbuild.c"],
                      optional=True)
    return [spans, Extension(
        "perfsdk._fastpath",
        sources=["perfsdk/_fastpath.c"],
        include_dirs=[include] if include else [],
        define_macros=[("PERFSDK_NVTX", "1")] if include else [],
        libraries=["dl"] if include and sys.platform.startswith("linux") else [],
        optional=True,
    )]


setup(ext_modules=extensions())
