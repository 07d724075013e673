"""The PyTorch releases remat runs on, checked as remat is imported.

remat needs PyTorch 2.5 or later. Older releases were tried and fail in
ways a user would not trace back to the version:

- before 2.5 the autograd engine does not tell a saved-tensor hook whether
  the running backward keeps its graph (``retain_graph``), so recomputed
  activations cannot be let go as the engine uses them; they stay until
  their stage's backward ends and a step can go over its budget (seen on
  2.2: a random chain's peak 9% over);
- before 2.2 a Python object of a tensor storage is not kept with the
  storage, so the weak references the memory meter follows storages with
  crash the garbage collector (a segmentation fault on 2.1);
- before 2.4 the autocast state of a device type cannot be asked for by
  name, nor before 2.2 the leaves of a nest of arguments.
"""

import re

__all__ = ["MINIMUM", "require_torch"]

MINIMUM = (2, 5)


def require_torch(version):
    """Raise ImportError if ``version`` (a ``torch.__version__``) is older than ``MINIMUM``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(int(p) for p in found.groups()) >= MINIMUM:
        return
    need = ".".join(map(str, MINIMUM))
    raise ImportError(
        f"remat needs PyTorch {need} or later; this is PyTorch {version}. Older releases cannot tell "
        f"remat whether a backward keeps its graph, so recomputed activations would outlive their use "
        f"and a step could go over its memory budget. Upgrade with: pip install -U 'torch>={need}'"
    )
