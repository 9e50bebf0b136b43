"""Hugging Face models: a sharded checkpoint of one resumes exactly at another stage, and the
Hugging Face layout (``checkpoint.hf_layout``, what a whole-model export writes) of its weights
is a model directory: ``from_pretrained(dir)`` reproduces ``engine.full_state_dict()`` exactly,
tied weights tied, for one ``model.safetensors`` and for sharded safetensors with
``model.safetensors.index.json``."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from pathlib import Path  # noqa: E402

from poplar.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from poplar.checkpoint.hf_layout import shard_bytes, write_model  # noqa: E402
from poplar.checkpoint.save import unshared_cpu  # noqa: E402
from poplar.process.launch import spawn  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from tests.toy import plan_of  # noqa: E402
from tests.workloads.hf_tiny import global_batch, loss_fn_of, make_model, optimizer, rank_part  # noqa: E402

PLAN = plan_of((2, 2, 0), (1, 2, 0))  # n_i = 4, 2
KINDS = ("gpt2", "llama", "bert")
SHARD = 20_000  # bytes: each tiny model (about 100 KB) becomes several shards


def worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for kind in KINDS:
        model = make_model(kind)
        engine = PoplarEngine(model, optimizer(model), zero_stage=3, plan=PLAN, loss_fn=loss_fn_of(kind))
        engine.train_step(rank_part(global_batch(kind, 0, PLAN.global_batch_size), PLAN, rank))
        save_checkpoint(engine, os.path.join(root, kind, "ckpt"))
        full = engine.full_state_dict()
        if rank == 0:  # the whole model in the Hugging Face layout, as an export writes it
            for layout, limit in (("single", None), ("sharded", SHARD)):
                Path(root, kind, layout).mkdir(parents=True)
                write_model(Path(root, kind, layout), unshared_cpu(full), engine.module, shard_bytes(limit))
        fresh = make_model(kind, seed=1)  # Poplar resumes from its checkpoint at another stage
        other = PoplarEngine(fresh, optimizer(fresh), zero_stage=1, plan=PLAN, loss_fn=loss_fn_of(kind))
        load_checkpoint(other, os.path.join(root, kind, "ckpt"))
        resumed = all(torch.equal(v, full[k]) for k, v in other.full_state_dict().items())
        out[kind] = (full, resumed)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("hf"))
    return root, spawn(worker, 2, (root,), timeout_s=240)


def auto_class(kind: str):
    import transformers

    return transformers.AutoModelForMaskedLM if kind == "bert" else transformers.AutoModelForCausalLM


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.multiprocess
def test_from_pretrained_reproduces_the_engine_state(kind: str, layout: str, saved: tuple[str, list[dict]]) -> None:
    root, results = saved
    full, resumed = results[0][kind]
    directory = os.path.join(root, kind, layout)
    model = auto_class(kind).from_pretrained(directory)
    state = model.state_dict()
    assert state.keys() == full.keys()
    assert all(torch.equal(state[k], full[k]) for k in full), [k for k in full if not torch.equal(state[k], full[k])]
    initial = make_model(kind).state_dict()
    assert not all(torch.equal(initial[k], full[k]) for k in full)  # the trained weights, not a fresh init
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied again
    if kind == "bert":
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert resumed and results[1][kind][1]

    files = sorted(os.listdir(directory))
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    assert config["architectures"] == [type(make_model(kind)).__name__]
    assert ("generation_config.json" in files) == (kind != "bert")  # BERT does not generate
    if layout == "single":
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
        return
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 3 and "model.safetensors" not in files
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    hf_index = json.loads(open(os.path.join(directory, "model.safetensors.index.json")).read())
    assert set(hf_index["weight_map"]) == set(full) and set(hf_index["weight_map"].values()) == set(shards)
    assert hf_index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())
    for name in shards:  # each shard at most the limit, unless one tensor alone is larger
        size = os.path.getsize(os.path.join(directory, name))
        assert size <= SHARD + 4096 or name in [hf_index["weight_map"][k] for k in full
                                                if full[k].numel() * 4 > SHARD]


@pytest.mark.multiprocess
def test_a_missing_shard_is_a_checkpoint_error(saved: tuple[str, list[dict]], tmp_path) -> None:
    import shutil

    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(root, "gpt2", "ckpt"), copy)
    os.remove(copy / "__1_0.distcp")
    model = make_model("gpt2")
    engine = PoplarEngine(model, optimizer(model), zero_stage=0, plan=plan_of((2, 1, 0)))
    with pytest.raises(CheckpointError, match="__1_0.distcp is missing"):
        load_checkpoint(engine, copy)


def test_shard_sizes() -> None:
    assert shard_bytes(None) == 5 * 10**9 and shard_bytes(1234) == 1234
    assert shard_bytes("500MB") == 500 * 10**6 and shard_bytes("2GiB") == 2 * 2**30
    for bad in ("lots", 0, -5, True, 1.5):
        with pytest.raises(ValueError, match="max_shard_bytes"):
            shard_bytes(bad)
