"""The whole model for people, from a live engine and offline from a sharded checkpoint: a tiny
GPT-2 trained at ZeRO-3 on 3 gloo ranks (shard weights 5:1:2) is exported streaming
(``export_model``) and, from a ``torch.distributed.checkpoint`` checkpoint the 3 ranks wrote in
FSDP2's key convention with uneven shards, by ``poplar export CHECKPOINT_DIR OUT_DIR --hf`` in
this one process; ``AutoModelForCausalLM.from_pretrained`` of either folder gives the engine's
logits, and the weights are ``full_state_dict()`` bitwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from poplar.checkpoint.dcp_export import export_dcp, read_metadata  # noqa: E402
from poplar.checkpoint.export import export_model  # noqa: E402
from poplar.cli import main  # noqa: E402
from poplar.process.launch import spawn  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from tests.checkpoint.test_export import LiveAllocations, bitwise_equal  # noqa: E402
from tests.toy import plan_of, with_shards  # noqa: E402
from tests.workloads.hf_tiny import global_batch, loss_fn_of, make_model, optimizer, rank_part  # noqa: E402

PLAN = with_shards(plan_of((2, 2, 0), (1, 2, 0), (1, 1, 0)), (5, 1, 2))  # n_i = 4, 2, 1


def sharded_save(state: dict[str, torch.Tensor], model: torch.nn.Module, directory: str, world: int) -> None:
    """What FSDP2 saves: {"model": {name: DTensor}, "optim": {"state": ..., "param_groups": ...}},
    each parameter cut along dim 0 over the ranks (sizes such as 100 and 32 over 3: uneven)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sharded = {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() and v.shape[0] >= world else Replicate()])
               for k, v in state.items()}
    optim = {"state": {k: {"momentum_buffer": torch.zeros_like(v)} for k, v in sharded.items()},
             "param_groups": [{"lr": 0.5, "momentum": 0.9, "params": list(sharded)}]}
    dcp.save({"model": sharded, "optim": optim}, checkpoint_id=directory)
    if torch.distributed.get_rank() == 0:
        model.config.save_pretrained(directory)  # what --hf copies beside the weights


def worker(rank: int, world: int, root: str) -> dict:
    model = make_model("gpt2")
    engine = PoplarEngine(model, optimizer(model), zero_stage=3, plan=PLAN, loss_fn=loss_fn_of("gpt2"))
    engine.train_step(rank_part(global_batch("gpt2", 0, PLAN.global_batch_size), PLAN, rank))
    report = export_model(engine, os.path.join(root, "live"))
    full = engine.full_state_dict()
    probe = global_batch("gpt2", 1, 4)
    with torch.no_grad():  # a ZeRO-3 forward gathers block by block on every rank
        logits = engine.module(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    sharded_save(full, make_model("gpt2"), os.path.join(root, "dcp"), world)
    return {"full": full, "logits": logits, "report": report} if rank == 0 else {"report": report}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("export_hf")
    return root, spawn(worker, 3, (str(root),), timeout_s=240)


def logits_of(directory: Path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    probe = global_batch("gpt2", 1, 4)
    with torch.no_grad():
        return model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits


@pytest.mark.multiprocess
def test_live_export_loads_with_from_pretrained_and_gives_the_engines_logits(trained) -> None:
    root, results = trained
    full = results[0]["full"]
    streamed = load_file(str(root / "live" / "model.safetensors"))
    assert streamed.keys() == full.keys() and all(bitwise_equal(streamed[k], full[k]) for k in full)
    assert torch.equal(logits_of(root / "live"), results[0]["logits"])
    for r in results:  # no rank held more than one block of the model at once
        assert r["report"].peak_part_bytes < r["report"].total_bytes / 2


@pytest.mark.multiprocess
def test_offline_export_of_a_sharded_checkpoint_in_one_process(trained, tmp_path: Path, capsys) -> None:
    root, results = trained
    full = results[0]["full"]
    _, metadata = read_metadata(root / "dcp")  # the ranks' shards of a tensor differ in size
    assert any(len({tuple(c.sizes) for c in m.chunks}) > 1 for m in metadata.state_dict_metadata.values()
               if hasattr(m, "chunks"))
    out = tmp_path / "hf"
    assert main(["export", str(root / "dcp"), str(out), "--hf"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: {len(full)} tensors") and "config.json" in said
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    streamed = load_file(str(out / "model.safetensors"))
    assert streamed.keys() == full.keys() and all(bitwise_equal(streamed[k], full[k]) for k in full)
    assert torch.equal(logits_of(out), results[0]["logits"])

    # one tensor at a time: every allocation of the export, at its peak, is within two of the
    # largest tensor (the tensor loaded into and DCP's read of its shards), far below the model
    with LiveAllocations() as counted:
        done = export_dcp(root / "dcp", tmp_path / "again", max_shard_bytes="20KB")
    largest = max(v.numel() * v.element_size() for v in full.values())
    assert done.peak_tensor_bytes == largest and counted.peak <= 2 * largest < done.total_bytes / 2, \
        (counted.peak, largest, done.total_bytes)
    assert len(done.entry["shards"]) > 2 and (tmp_path / "again" / "model.safetensors.index.json").exists()


def test_export_refuses_what_is_not_a_sharded_checkpoint(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert main(["export", str(tmp_path / "plain"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no torch.distributed.checkpoint checkpoint" in err
    assert not (tmp_path / "out").exists()
    for step in ("step-00000010", "step-00000020"):  # a run's directory of checkpoints: name them
        (tmp_path / "plain" / step).mkdir()
        (tmp_path / "plain" / step / ".metadata").write_bytes(b"")
    assert main(["export", str(tmp_path / "plain"), str(tmp_path / "out")]) == 2
    assert f"e.g. {tmp_path / 'plain' / 'step-00000020'}" in capsys.readouterr().err


def test_hf_export_needs_the_config(tmp_path: Path, capsys) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.arange(6.0).view(2, 3)}}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--hf"]) == 2
    assert "carries no config.json" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], torch.arange(6.0).view(2, 3))


def test_export_names_a_damaged_checkpoint_and_replaces_older_weights(tmp_path: Path, capsys) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(4), "v": torch.zeros(2)}}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "ck"), str(out), "--max-shard-size", "16"]) == 0  # two shards
    assert len(list(out.glob("model-*.safetensors"))) == 2
    assert main(["export", str(tmp_path / "ck"), str(out)]) == 0  # one file: the shards and their index go
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    (tmp_path / "file").write_text("")
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    for shard in (tmp_path / "ck").glob("*.distcp"):
        shard.write_bytes(b"damaged")
    assert main(["export", str(tmp_path / "ck"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reading 'w' failed" in err and "missing or damaged" in err, err
