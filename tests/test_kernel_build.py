"""The CPU kernels build wherever they can (Linux, a C++ compiler, ninja). Every kernel test skips where they cannot,
so without this check a compile error would skip them all and the suite would still pass."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from torch.utils import cpp_extension

from models import matvec


def test_the_cpu_kernels_build_where_a_compiler_and_ninja_are_present():
    if sys.platform != "linux" or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on Linux here")
    if not cpp_extension.is_ninja_available():
        pytest.skip("no ninja here")
    assert matvec.available(), matvec.why_unavailable()
