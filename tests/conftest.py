"""Shared test settings."""

import os

import pytest
import torch

from poplar.comm import launch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread: on a busy 2-core machine, spinning OpenMP threads slow tiny models 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tests are hermetic: auto mode keeps no profiles in the user's cache unless a test gives a
# store (AutoOptions(store=...)); spawned ranks inherit the setting.
os.environ.setdefault("POPLAR_PROFILE_STORE", "off")

# Ranks the tests start (``poplar.comm.launch.spawn``) fork from a server that imported
# ``launch.PRELOAD`` once. Every rank builds an optimizer, and torch imports ``torch._dynamo`` at
# the first one (about 1 s of CPU): imported in the server instead, no rank pays for it again.
if "torch._dynamo" not in launch.PRELOAD:
    launch.PRELOAD.append("torch._dynamo")


# The README's snippets are the longest test (minutes of torchrun jobs): collected first, a
# worker of `make test` starts them at once and the other files run beside them, not after.
LONGEST_FIRST = ("tests/test_readme.py::",)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable: the rest keep their order
