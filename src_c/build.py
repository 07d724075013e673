"""cffi build script: compiles src_c/solver.c and mintime.c into ``remat._solver``
(out-of-line API mode; named by setup.py's ``cffi_modules``)."""

import os
import re

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


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "remat._solver",
    '#include "solver.h"',
    sources=[os.path.relpath(os.path.join(HERE, name)) for name in ("solver.c", "mintime.c")],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-O3", "-std=c99"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
