"""remat refuses, at import, PyTorch releases it does not run on (remat/torch_version.py)."""

import subprocess
import sys

import pytest
import torch

from remat.torch_version import MINIMUM, require_torch


@pytest.mark.parametrize("version", ["2.1.2+cu121", "2.4.1", "1.13.1", "2.4.0a0+git1234567"])
def test_older_releases_are_refused_with_the_fix(version):
    with pytest.raises(ImportError) as err:
        require_torch(version)
    message = str(err.value)
    assert f"this is PyTorch {version}" in message
    assert "pip install -U 'torch>=2.5'" in message


@pytest.mark.parametrize("version", ["2.5.0", "2.5.1+cpu", "2.13.0", "2.10.0a0+gitabcdef", "3.0.0", "nightly"])
def test_supported_releases_pass(version):
    # (2.13 compares as a number, not as text; a version remat cannot read is let through)
    require_torch(version)


def test_the_installed_torch_is_supported_and_checked_on_import():
    assert tuple(int(p) for p in torch.__version__.split(".")[:2]) >= MINIMUM
    # importing remat with an older torch reported fails with the message
    code = ("import torch; torch.__version__ = '2.2.2'\n"
            "try:\n    import remat\nexcept ImportError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("refused: remat needs PyTorch 2.5 or later; this is PyTorch 2.2.2")
