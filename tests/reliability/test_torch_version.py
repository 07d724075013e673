"""remat refuses, at import, PyTorch releases it does not run on (remat/torch_version.py)."""

import re
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, strategies as st

from remat.torch_version import MINIMUM, require_torch


@pytest.mark.parametrize("version", ["2.1.2+cu121", "2.4.1", "1.13.1", "2.4.0a0+git1234567"])
def test_older_releases_are_refused_with_the_fix(version):
    with pytest.raises(ImportError) as err:
        require_torch(version)
    message = str(err.value)
    assert f"this is PyTorch {version}" in message
    assert "pip install -U 'torch>=2.5'" in message


@given(major=st.integers(0, 4), minor=st.integers(0, 30), patch=st.integers(0, 12),
       suffix=st.sampled_from(["", "+cpu", "+cu121", "a0+git1234567", "rc1", ".post1"]))
@example(2, 5, 0, "")
@example(2, 5, 1, "+cpu")
@example(2, 13, 0, "")              # 13 > 5 as a number, though "2.13" < "2.5" as text
@example(2, 10, 0, "a0+gitabcdef")
@example(3, 0, 0, "")
@example(2, 4, 99, "")
def test_supported_releases_pass(major, minor, patch, suffix):
    """A release passes (``require_torch`` returns None) exactly when its major and minor
    numbers, compared as numbers, are at least ``MINIMUM``; any other release is refused
    with an ImportError naming it."""
    version = f"{major}.{minor}.{patch}{suffix}"
    if (major, minor) >= MINIMUM:
        assert require_torch(version) is None
    else:
        with pytest.raises(ImportError, match=re.escape(f"this is PyTorch {version}.")):
            require_torch(version)


def test_a_version_remat_cannot_read_is_let_through_at_import():
    """A ``torch.__version__`` with no major.minor to read (a custom build's) does not stop
    ``import remat``."""
    code = ("import torch; torch.__version__ = 'nightly'\n"
            "import remat\n"
            "print('imported', remat.chain.__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "imported chain"


def test_the_installed_torch_is_supported_and_checked_on_import():
    assert tuple(int(p) for p in torch.__version__.split(".")[:2]) >= MINIMUM
    # importing remat with an older torch reported fails with the message
    code = ("import torch; torch.__version__ = '2.2.2'\n"
            "try:\n    import remat\nexcept ImportError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("refused: remat needs PyTorch 2.5 or later; this is PyTorch 2.2.2")
