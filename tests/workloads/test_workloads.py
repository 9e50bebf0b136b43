"""The built-in workloads: each builds, its batches are deterministic and well formed, its loss
trains, it survives pickling (it travels to spawned ranks), and it runs under a virtual device."""

from __future__ import annotations

import pickle

import pytest
import torch

from poplar.zero.batches import batch_size_of, slice_batch
from poplar.workloads.models import BertModel, LlamaModel, count_params
from poplar.workloads.text import IGNORE_INDEX, VOCAB_SIZE
from poplar.workloads import DEFAULT_WORKLOAD, WORKLOADS, TokenMLP, get_workload
from poplar.zero.config import ZeroConfig

NAMES = list(WORKLOADS)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def test_the_registry() -> None:
    assert {"llama-tiny", "llama-small", "bert-tiny", "bert-small", "token-mlp"} <= set(NAMES)
    for name, w in WORKLOADS.items():
        assert w.name == name and w.description
    llamas = [n for n in NAMES if n.startswith("llama-")]
    assert DEFAULT_WORKLOAD == min(llamas, key=lambda n: count_params(WORKLOADS[n].model_fn().config))


@pytest.mark.parametrize("name", NAMES)
def test_model_fn_gives_the_same_weights_every_call(name: str) -> None:
    w = get_workload(name)
    rng = torch.get_rng_state()
    a, b = w.model_fn(), w.model_fn()
    assert torch.equal(torch.get_rng_state(), rng)  # building leaves the global RNG alone
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    family = name.partition("-")[0]
    assert isinstance(a, {"llama": LlamaModel, "bert": BertModel, "token": TokenMLP}[family])


@pytest.mark.parametrize("name", NAMES)
def test_sample_fn_is_deterministic_and_well_formed(name: str) -> None:
    w = get_workload(name)
    for b in (1, 3, 8):
        batch = w.sample_fn(b)
        assert same(batch, w.sample_fn(b)) and batch_size_of(batch) == b
    assert not same(w.sample_fn(8), slice_batch(w.sample_fn(9), 0, 8))  # b seeds the batch
    batch = w.sample_fn(8)
    if name.startswith("bert-"):
        assert set(batch) == {"input_ids", "labels"}
        ids, labels = batch["input_ids"], batch["labels"]
        assert ids.shape == labels.shape and ids.dtype == labels.dtype == torch.int64
        assert ((labels != IGNORE_INDEX).sum(dim=1) >= 1).all()  # every sample carries a loss
        assert ((labels == IGNORE_INDEX) | (labels < 256)).all() and (ids < VOCAB_SIZE).all()
        assert ids.shape[1] <= WORKLOADS[name].model_fn().config.max_seq_len
    else:
        assert batch.dtype == torch.int64 and batch.dim() == 2 and batch.shape[1] >= 2
        assert batch.min() >= 0
    if name.startswith("llama-"):
        assert batch.max() < VOCAB_SIZE and batch.shape[1] - 1 <= w.model_fn().config.max_seq_len


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_corpus_batches_are_distinct_blocks_then_wrap(name: str) -> None:
    w = get_workload(name)
    key = (lambda x: x["input_ids"]) if name.startswith("bert-") else (lambda x: x)
    small = key(w.sample_fn(50))
    assert len({tuple(r) for r in small.tolist()}) == 50
    big = key(w.sample_fn(2000))  # more samples than the corpus has blocks: the blocks come round again
    n = len({tuple(r) for r in big.tolist()})
    assert 50 < n < 2000 and torch.equal(big[:n], big[n:2 * n])
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        w.sample_fn(0)


@pytest.mark.parametrize("name", NAMES)
def test_loss_is_finite_and_backward_reaches_every_parameter(name: str) -> None:
    w = get_workload(name)
    model = w.model_fn()
    loss = w.loss_fn(model, w.sample_fn(2))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())
    before = loss.item()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):  # and it trains: a few steps on the same batch lower its loss
        opt.step()
        opt.zero_grad()
        w.loss_fn(model, w.sample_fn(2)).backward()
    assert w.loss_fn(model, w.sample_fn(2)).item() < before - 0.05


@pytest.mark.parametrize("name", NAMES)
def test_workloads_survive_pickling(name: str) -> None:
    w = get_workload(name)
    back = pickle.loads(pickle.dumps(w))
    assert back.name == w.name and same(back.sample_fn(4), w.sample_fn(4))
    torch.testing.assert_close(back.loss_fn(back.model_fn(), w.sample_fn(4)), w.loss_fn(w.model_fn(), w.sample_fn(4)))


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_a_capacity_trial_under_a_virtual_device(name: str) -> None:
    """The profiler's path: the engine takes the workload's batches, the device counts their memory."""
    from poplar.emulation import VirtualDevice
    from poplar.profiler.capacity import CapacitySearch
    from poplar.profiler.local_comm import local_engine
    from poplar.profiler.profile_run import default_optimizer

    w = get_workload(name)
    model = w.model_fn()
    engine = local_engine(model, default_optimizer(model), world_size=2, rank=0, zero_stage=ZeroConfig(2, bucket_size_mb=0.1),
                          device=torch.device("cpu"))
    device = VirtualDevice("d", 10 ** 9)
    with device.attach(engine):
        search = CapacitySearch(engine, device, w.sample_fn, w.loss_fn, 2)
        assert search.trial(1) and search.trial(4)
        assert device.last_step.after_forward > device.last_step.before_forward


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown workload 'llama-huge'") as info:
        get_workload("llama-huge")
    assert all(n in str(info.value) for n in NAMES)


def test_profile_command_defaults_to_the_smallest_llama(capsys) -> None:
    from poplar.cli import build_parser, main

    args = build_parser().parse_args(["profile", "--cluster", "A"])
    assert args.model == DEFAULT_WORKLOAD == "llama-tiny"
    with pytest.raises(SystemExit):
        main(["profile", "--cluster", "A", "--model", "tiny-transformer"])
    assert "invalid choice: 'tiny-transformer'" in capsys.readouterr().err
