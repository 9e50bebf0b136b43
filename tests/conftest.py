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


# How `make test` hands out the tests: in groups, three workers each running one group at a time
# (`--dist loadgroup`). A group is a test file (a file's fixtures are built once), but for
# tests/test_readme.py, whose pages run apart from each other: there each page (the network pages
# together, one test reads all three) is a group (`test_readme.page_group`), so the README's runs
# and the guide pages' share the workers instead of queueing on one.
#
# The groups that take longest, longest first, down to about 1 % of the parallel pass's test time
# each (their costs as measured in one `--durations=0` run of the parallel pass on this 2-core
# machine: the README's runs about 11 %, the next about 6 %). Groups go out in collection order
# (`--no-loadscope-reorder`), a worker taking its next group when its current one has two tests
# left, so these start first and the many short files fill in beside them: a long group started
# last would run on alone at the end while the other workers idle.
LONGEST_FIRST = (
    "readme:README.md",
    "tests/cli/test_restarts.py",
    "tests/integrations/test_lightning.py",
    "tests/profiler/test_profiler.py",
    "tests/integrations/test_hf.py",
    "tests/cli/test_job_ownership.py",
    "readme:docs/engine.md",
    "readme:docs/checkpoints.md",
    "tests/zero/test_offload.py",
    "tests/cli/test_train_cli.py",
    "tests/zero/test_hierarchical_zero.py",
    "tests/integrations/test_stalled_rank.py",
    "readme:docs/integrations.md",
    "tests/cli/test_preemption.py",
    "tests/cli/test_offload_cli.py",
    "readme:docs/checkpoint-format.md",
    "tests/engine/test_compile.py",
    "tests/engine/test_profile_store.py",
    "tests/profiler/test_precision_profile.py",
    "tests/zero/test_uneven_shards.py",
    "tests/zero/test_stage3_parity.py",
    "readme:docs/compile.md",
    "tests/integrations/test_datasets.py",
    "tests/profiler/test_offload_profile.py",
    "tests/checkpoint/test_checkpoint_kept.py",
    "readme:docs/configuration.md",
    "tests/cli/test_sigterm_blocked.py",
    "tests/process/test_launch.py",
    "readme:network pages",
    "tests/zero/test_mixed_precision.py",
    "tests/zero/test_quantized_zero.py",
    "readme:docs/export.md",
    "tests/checkpoint/test_sharded_checkpoint.py",
    "tests/cli/test_finetune_cli.py",
)


def group_of(item: pytest.Item) -> str:
    """The item's group: its own ``xdist_group`` mark (test_readme's pages), else its file."""
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark is not None else item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks into the test ids
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item)))

    def rank(item: pytest.Item) -> int:
        group = group_of(item)
        return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
