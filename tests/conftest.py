"""Shared test settings."""

import gc
import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread: on a busy 2-core machine, spinning OpenMP threads slow tiny models 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_finish(session: pytest.Session) -> None:
    """[Note: the collector sees only what the tests make]
    Every recovery from an out-of-memory error collects reference cycles (``Device.release``, the
    capacity search's rebuild): a full ``gc.collect()``, which walks every object in the process.
    After collection that is torch, torch._dynamo (imported by the first optimizer), the HF and
    Lightning stacks and every test module: millions of objects, a second or more a call on a
    busy 2-core machine, and a capacity search recovers many times. Those objects live for the
    whole session, so they are moved out of the collector's sight once (``gc.freeze``): a
    collection then walks only what the tests made since, and frees the same cycles."""
    import torch._dynamo  # noqa: F401 - imported here so that it is frozen with the rest

    gc.collect()
    gc.freeze()


# Tests are hermetic: auto mode keeps no profiles in the user's cache unless a test gives a
# store (AutoOptions(store=...)); spawned ranks inherit the setting.
os.environ.setdefault("POPLAR_PROFILE_STORE", "off")


# The files that take longest, longest first (their share of `make test`'s test time on this
# 2-core machine, about 15 % for the README's runs down to about 1 % for the last). `make test`
# hands its two workers whole files in collection order (`--no-loadscope-reorder`), so these
# start first and the many short files fill in beside them: a long file started last would run
# on alone at the end while the other worker idles.
LONGEST_FIRST = (
    "tests/test_readme.py",
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_hf.py",
    "tests/profiler/test_profiler.py",
    "tests/cli/test_train_cli.py",
    "tests/cli/test_job_ownership.py",
    "tests/engine/test_engine_parity.py",
    "tests/cli/test_restarts.py",
    "tests/profiler/test_precision_profile.py",
    "tests/zero/test_offload.py",
    "tests/engine/test_auto_config.py",
    "tests/zero/test_uneven_shards.py",
    "tests/cli/test_preemption.py",
    "tests/profiler/test_points_past_mbs.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
