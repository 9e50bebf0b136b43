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


# The files that take longest, longest first, down to about 1 % of `make test`'s test time each
# (their costs as measured in one `--durations=0` run of the parallel pass on this 2-core machine:
# the README's runs about 25 %, the next about 8 %). `make test` hands its workers whole files
# in collection order (`--no-loadscope-reorder`), a worker taking its next file when its current
# one has two tests left, so these start first and the many short files fill in beside them: a
# long file started last would run on alone at the end while the other workers idle.
LONGEST_FIRST = (
    "tests/test_readme.py",
    "tests/cli/test_restarts.py",
    "tests/profiler/test_profiler.py",
    "tests/integrations/test_hf.py",
    "tests/cli/test_train_cli.py",
    "tests/zero/test_hierarchical_zero.py",
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_stalled_rank.py",
    "tests/cli/test_job_ownership.py",
    "tests/zero/test_offload.py",
    "tests/engine/test_profile_store.py",
    "tests/cli/test_preemption.py",
    "tests/zero/test_stage3_parity.py",
    "tests/cli/test_offload_cli.py",
    "tests/profiler/test_precision_profile.py",
    "tests/engine/test_compile.py",
    "tests/cli/test_finetune_cli.py",
    "tests/checkpoint/test_checkpoint_kept.py",
    "tests/process/test_launch.py",
    "tests/zero/test_uneven_shards.py",
    "tests/zero/test_stage3_ledger.py",
    "tests/engine/test_auto.py",
    "tests/zero/test_activation_checkpointing.py",
    "tests/workloads/test_hf_parity.py",
    "tests/cli/test_sigterm_blocked.py",
    "tests/profiler/test_offload_profile.py",
    "tests/zero/test_left_out.py",
    "tests/zero/test_mixed_precision.py",
    "tests/profiler/test_scripted_profile.py",
    "tests/checkpoint/test_sharded_checkpoint.py",
    "tests/integrations/test_datasets.py",
    "tests/zero/test_quantized_zero.py",
    "tests/cli/test_torchrun_summary.py",
    "tests/engine/test_engine_parity.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
