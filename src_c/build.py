"""cffi build script: compiles src_c/solver.c, problem.c, minmemory.c and mintime*.c into
``remat.solver._solver`` (out-of-line API mode; named by setup.py's ``cffi_modules``)."""

import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef():
    """The declarations between the "cdef begin/end" markers of solver.h."""
    with open(os.path.join(HERE, "solver.h")) as fh:
        text = fh.read()
    match = re.search(r"/\* cdef begin \*/(.*)/\* cdef end \*/", text, re.S)
    if match is None:
        raise RuntimeError("src_c/solver.h lost its 'cdef begin/end' markers")
    return match.group(1)


def _openmp_flags():
    """["-fopenmp"] if the C compiler builds and links an OpenMP program, else [].

    The solver runs without OpenMP too (one thread); REMAT_NO_OPENMP=1 forces that.
    """
    if os.environ.get("REMAT_NO_OPENMP") or sys.platform == "win32":
        return []
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.c")
        with open(src, "w") as fh:
            fh.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        try:
            done = subprocess.run(shlex.split(cc) + ["-fopenmp", src, "-o", os.path.join(tmp, "omp")],
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return []
    return ["-fopenmp"] if done.returncode == 0 else []


OPENMP = _openmp_flags()
ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "remat.solver._solver",
    '#include "solver.h"',
    sources=[os.path.relpath(os.path.join(HERE, name))
             for name in ("solver.c", "problem.c", "minmemory.c", "mintime.c", "mintime_table.c", "mintime_row.c")],
    include_dirs=[os.path.relpath(HERE)],
    # (a header changed rebuilds every source: they share its structs and inline functions)
    depends=[os.path.relpath(os.path.join(HERE, name)) for name in ("solver.h", "internal.h", "mintime.h")],
    extra_compile_args=["-O3", "-std=c99"] + OPENMP,
    extra_link_args=OPENMP,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
