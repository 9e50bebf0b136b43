"""Shared test settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread: on a busy 2-core machine, spinning OpenMP threads slow tiny models 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
