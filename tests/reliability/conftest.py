"""Fixtures shared by the reliability tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add contention (and seconds) here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
