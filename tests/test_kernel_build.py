"""The CPU kernels build wherever they can (Linux, a C++ compiler, ninja). Every kernel test skips where they cannot,
so without this check a compile error would skip them all and the suite would still pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from torch.utils import cpp_extension

from models.kernels import native
from tests.checkpoints import ROOT


def test_the_cpu_kernels_build_where_a_compiler_and_ninja_are_present():
    if sys.platform != "linux" or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on Linux here")
    if not cpp_extension.is_ninja_available():
        pytest.skip("no ninja here")
    assert native.available(), native.why_unavailable()


def _load_in_a_process(**env) -> str:
    code = ("import sys; from models.kernels import native; "
            "print(native.available(), 'torch.utils.cpp_extension' in sys.modules, native.why_unavailable())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_process_loads_the_kernels_built_before_without_torchs_build_machinery():
    if not native.available():
        pytest.skip(f"the CPU kernels do not build here: {native.why_unavailable()}")
    assert _load_in_a_process() == "True False"  # no import of cpp_extension, no ninja: built before, loaded


def test_a_build_cut_short_is_linked_again(tmp_path):
    if not native.available():
        pytest.skip(f"the CPU kernels do not build here: {native.why_unavailable()}")
    library = native.built_library()
    shutil.copytree(library.parent, tmp_path / library.parent.name)  # the objects stay: only the link runs again
    cut = tmp_path / library.parent.name / library.name
    cut.write_bytes(b"\x7fELF cut short")
    assert _load_in_a_process(TORCH_EXTENSIONS_DIR=str(tmp_path)) == "True True"  # built (linked) again, loaded
    assert cut.stat().st_size > 1000


def test_every_source_is_in_the_build_key_and_every_cpp_in_exactly_one_unit():
    """The compiler sees only the units (`native.UNITS`), the build's name hashes `native.SOURCES`: a file missing
    from either would be left out of the build, or changed without a rebuild."""
    csrc = native.SOURCES[0].parent
    assert sorted(native.SOURCES) == sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))
    included = [line.split('"')[1] for unit in native.UNITS for line in unit.read_text().splitlines()
                if line.startswith("#include")]
    assert sorted(included) == sorted(p.name for p in native.SOURCES if p.suffix == ".cpp" and p not in native.UNITS)
