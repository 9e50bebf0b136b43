"""`poplar simulate` what-ifs (--add beside the current cluster, --model, --stage auto's candidate
table), `poplar plan --stage auto` from a profile auto mode saved, and output into a closed pipe
ending without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poplar.cli import main
from poplar.cli.model_specs import resolve_model
from poplar.planner.candidates import CandidateRow
from poplar.emulation.synthetic import synthetic_profile
from poplar.types.profiles import AutoChoice

ROOT = Path(__file__).resolve().parents[2]
SIMULATE = [sys.executable, "-m", "poplar", "simulate", "--cluster", "B", "--gbs", "64", "--stage", "auto",
            "--add", "T4-16G:2"]


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.multiprocess
def test_output_into_head_ends_without_a_traceback() -> None:
    cmd = " ".join(SIMULATE) + " | head -1"
    p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("model ") and len(p.stdout.splitlines()) == 1, p
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


@pytest.mark.multiprocess
def test_output_into_a_closed_pipe_ends_without_a_traceback() -> None:
    # the reading end is closed before the command writes anything: every write fails
    p = subprocess.Popen(SIMULATE, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_add_shows_both_clusters_side_by_side(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "simulate", "--cluster", "B", "--gbs", "256", "--stage", "2", "--add", "T4-16G:2")
    assert code == 0
    lines = out.splitlines()
    assert "current" in lines[1] and "with --add T4-16G:2" in lines[1]
    assert lines[2].split()[1:3] == ["B:", "2x"] and "B+2xT4-16G: 2x V100-16G + 4x T4-16G" in lines[2]
    assert lines[3].split() == ["ranks", "4", "6"]
    poplar = next(x for x in lines if x.startswith("poplar samples/s")).split()
    assert float(poplar[3]) > float(poplar[2]) and poplar[4].endswith("x)")  # two more T4s help at gbs 256
    # then each cluster's own table
    assert sum(x.startswith("cluster B: ") for x in lines) == 1 and sum(x.startswith("cluster B+2x") for x in lines) == 1


def test_stage_auto_shows_the_candidate_table(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out_json = tmp_path / "sim.json"
    code, out, _ = _run(capsys, "simulate", "--cluster", "A", "--gbs", "256", "--stage", "auto", "--model",
                        "llama-1.1b", "--json", str(out_json))
    assert code == 0
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("config"))
    assert "mbs A100-40G" in lines[head] and "mbs A100-80G" in lines[head] and "predicted s" in lines[head]
    table = lines[head + 1:head + 9]
    assert [x.split()[0] + (" +ckpt" if "+ckpt" in x else "") for x in table] == \
        [f"ZeRO-{s}" for s in range(4)] + [f"ZeRO-{s} +ckpt" for s in range(4)]
    assert sum("CHOSEN" in x for x in table) == 1
    assert "no" in table[0].split() and "does not fit on A100-40G" in table[0]  # 1.1B at ZeRO-0 on 40 GB
    saved = json.loads(out_json.read_text())
    rows = [CandidateRow.from_dict(d) for d in saved["candidates"]]
    chosen = next(r for r in rows if r.chosen)
    assert chosen.checkpointing and saved["config"] == chosen.name  # checkpointing wins where memory binds
    assert chosen.predicted_s == min(r.predicted_s for r in rows if r.fits)
    assert saved["first_fit"] == "ZeRO-2"


def test_model_from_a_hf_config(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257,
           "activation_function": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = resolve_model(str(path))
    assert abs(model.plain.param_count - 124.4e6) < 1e6  # GPT-2 small
    assert model.checkpointed.activation_bytes_per_sample < model.plain.activation_bytes_per_sample / 2
    assert model.checkpointed.work_scale > model.plain.work_scale
    code, out, _ = _run(capsys, "simulate", "--cluster", "B", "--gbs", "64", "--stage", "1", "--model", str(path),
                        "--seq", "512")
    assert code == 0 and "[gpt2]" in out and "seq 512" in out
    path.write_text(json.dumps({"vocab_size": 10}))
    code, _, err = _run(capsys, "simulate", "--cluster", "B", "--gbs", "64", "--stage", "1", "--model", str(path))
    assert code == 2 and "hidden_size" in err and "transformer" in err


def test_plan_stage_auto_reads_the_candidates_auto_mode_saved(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    profile = synthetic_profile("B", 1)
    mbs = {r.device_type: r.mbs for r in profile.ranks}
    rows = [CandidateRow(0, False, False, {t: 0 for t in mbs}, reason="batch 1 does not fit on rank 0"),
            CandidateRow(1, False, True, mbs, 1.0, True, chosen=True),
            CandidateRow(3, False, True, {t: m + 1 for t, m in mbs.items()}, 2.0, False)]
    profile.auto_choice = AutoChoice("fastest", [r.to_dict() for r in rows])
    path = tmp_path / "profile.json"
    profile.save(path)
    code, out, _ = _run(capsys, "plan", "--profile", str(path), "--gbs", "128", "--stage", "auto",
                        "-o", str(tmp_path / "plan.json"))
    assert code == 0 and "CHOSEN" in out and "strategy poplar, ZeRO-1" in out
    assert "lower bound" in next(x for x in out.splitlines() if x.startswith("ZeRO-3"))
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert [r["chosen"] for r in saved["choice"]["candidates"]] == [False, True, False]
    # the same table from `poplar simulate --profile`
    code, out, _ = _run(capsys, "simulate", "--profile", str(path), "--gbs", "128", "--stage", "auto")
    assert code == 0 and "CHOSEN" in out and "ZeRO-1" in out
    # a single-configuration profile has no table: the error says how to get one
    plain = tmp_path / "plain.json"
    synthetic_profile("B", 1).save(plain)
    code, _, err = _run(capsys, "plan", "--profile", str(plain), "--gbs", "128", "--stage", "auto")
    assert code == 2 and "profile_output" in err and "poplar simulate" in err


def _c8(tmp_path: Path) -> str:
    path = tmp_path / "C8.json"
    path.write_text(json.dumps({"name": "C8", "devices": [{"type": "A800-80G", "count": 4},
                                                          {"type": "V100S-32G", "count": 4}],
                                "bandwidth_gbps": 10.0, "latency_us": 30.0}))
    return str(path)


def test_nodes_ask_whether_the_last_node_is_worth_adding(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    cluster, out_json = _c8(tmp_path), tmp_path / "nodes.json"
    answers = {}
    for inter in ("10gbit", "12.5"):
        code, out, _ = _run(capsys, "simulate", "--cluster", cluster, "--gbs", "128", "--stage", "3", "--nodes", "4,4",
                            "--intra-gbps", "16", "--inter-gbps", inter, "--json", str(out_json))
        assert code == 0 and "as 2 nodes: [0-3] [4-7]" in out and "between nodes 1" in out
        rows = json.loads(out_json.read_text())
        assert [r["cluster"] for r in rows] == ["all nodes", "without the last node"] and rows[1]["ranks"] == 4
        whole = rows[0]
        # every GPU at work: each way planned with its fields set, the fastest the node's worth
        best = min(("flat", "hierarchical", "secondary_shards", "once_per_iteration"),
               key=lambda w: whole[w]["iteration_s"])
        plan = whole[best]["plan"]
        assert plan["collectives"] == best
        assert whole["every_gpu_samples_per_s"] == whole[best]["samples_per_s"]
        assert rows[1]["hierarchical"] is None and rows[1]["chosen"] == "flat"  # one node: flat alone
        answers[inter] = whole["every_gpu_samples_per_s"] / rows[1]["chosen_samples_per_s"]
        # the planner's choice: the V100S node left out where it is not worth it, else the fastest way
        if answers[inter] < 1:
            assert whole["left_out"] == [4, 5, 6, 7] and whole["chosen"] == "flat"
            assert whole["chosen_samples_per_s"] == rows[1]["chosen_samples_per_s"]
        else:
            assert whole["left_out"] == [] and whole["chosen"] == best
        assert f"adding the last node: {answers[inter]:.2f}x" in out
    # 10 Gbit/s between nodes: the V100S node costs more in communication than it brings; 100 Gbit/s: worth it
    assert answers["10gbit"] < 1 < answers["12.5"]
    assert "not worth it" in _run(capsys, "simulate", "--cluster", cluster, "--gbs", "128", "--stage", "3",
                                  "--nodes", "4,4", "--inter-gbps", "10gbit")[1]


def test_nodes_with_allow_lossy_price_each_quantized_option(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out_json = tmp_path / "lossy.json"
    code, out, err = _run(capsys, "simulate", "--cluster", "C-4+4", "--gbs", "256", "--stage", "3", "--nodes", "4,4",
                          "--intra-gbps", "16", "--inter-gbps", "10gbit", "--allow-lossy", "--json", str(out_json))
    assert code == 0, err
    assert "all nodes, allow_lossy: exact " in out and "weights int8 and gradients int8" in out
    assert "without the last node, allow_lossy: nothing to quantize (one node, or ZeRO-0/1): exact" in out
    rows = json.loads(out_json.read_text())
    lossy = rows[0]["allow_lossy"]["plan"]
    record = lossy["choice"]["compression_choice"]
    # 10 Gbit/s between the nodes: quantized across them, predicted faster than every exact plan
    assert lossy["compression"] == record["chosen"] and record["chosen"]["weights"] == "int8"
    assert record["exact_s"] == pytest.approx(rows[0]["chosen_samples_per_s"] ** -1 * 256)
    assert record["saving_s"] > record["tie"] * record["exact_s"]
    assert rows[1]["allow_lossy"]["plan"]["compression"]["weights"] == "none"
    assert "allow_lossy" not in _run(capsys, "simulate", "--cluster", "C-4+4", "--gbs", "256", "--stage", "3",
                                     "--nodes", "4,4", "--inter-gbps", "10gbit")[1]


def test_plan_with_allow_lossy_says_each_option(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from tests.planner.test_link_pricing import SLOW, profile, two_nodes

    path = tmp_path / "two_nodes.json"
    profile(two_nodes(cross=SLOW), stage=3).save(path)
    # one micro-step a rank: quantizing the crossings pays; six: crossing once per iteration, exact, is faster
    code, out, err = _run(capsys, "plan", "--profile", str(path), "--gbs", "200", "--allow-lossy")
    assert code == 0, err
    assert "  exact: " in out and "chosen (allow_lossy): predicted" in out and out.count(" <- kept") == 1
    many = _run(capsys, "plan", "--profile", str(path), "--gbs", "1000", "--allow-lossy")[1]
    assert "across nodes once per iteration, exact collectives kept (allow_lossy)" in many, many
    exact = _run(capsys, "plan", "--profile", str(path), "--gbs", "200")[1]
    assert "allow_lossy" not in exact and "quantized" not in exact


def test_nodes_on_a_built_in_cluster_that_declares_its_own(capsys: pytest.CaptureFixture) -> None:
    # C-4+4 declares two nodes of 4: the cluster without its last node is 4 ranks on one node
    code, out, err = _run(capsys, "simulate", "--cluster", "C-4+4", "--gbs", "256", "--stage", "3", "--nodes", "4,4",
                          "--intra-gbps", "16,8", "--inter-gbps", "10gbit")
    assert code == 0, err
    assert "without the last node  4      1 node" in out and "adding the last node:" in out


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "4,3", "--inter-gbps", "1"], "adding up to the cluster's 8 ranks"),
    (["--nodes", "4,4"], "needs the link between them: --inter-gbps"),
    (["--nodes", "4,4", "--inter-gbps", "fast"], "--inter-gbps 'fast': give a bandwidth > 0"),
    (["--nodes", "2,2,4", "--intra-gbps", "1,2", "--inter-gbps", "1"], "one bandwidth for every node or one per node"),
    (["--inter-gbps", "1"], "give the ranks per node too"),
])
def test_bad_nodes_and_links_are_named(capsys: pytest.CaptureFixture, tmp_path: Path, argv: list[str],
                                       message: str) -> None:
    code, _, err = _run(capsys, "simulate", "--cluster", _c8(tmp_path), "--gbs", "256", "--stage", "3", *argv)
    assert code != 0 and message in err, err


def test_nodes_verdict_weighs_lossy_plans_and_names_the_ranks_left_out_with_the_reason(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """At 10 Gbit/s between the nodes and a global batch of 128, the V100S node is not worth adding
    with exact collectives (the planner leaves it out) but is with lossy ones: the verdict says
    both, and the line on the ranks left out gives the compute they would take off against the
    link time they would add."""
    import re

    out_json = tmp_path / "lossy.json"
    code, out, err = _run(capsys, "simulate", "--cluster", "C-4+4", "--stage", "3", "--nodes", "4,4", "--intra-gbps",
                          "16,8", "--inter-gbps", "10gbit", "--gbs", "128", "--allow-lossy", "--json", str(out_json))
    assert code == 0, err
    whole, alone = json.loads(out_json.read_text())
    exact_gain = whole["every_gpu_samples_per_s"] / alone["chosen_samples_per_s"]
    lossy = whole["allow_lossy"]
    assert lossy["plan"]["compression"]["weights"] == "int8" and not any(
        r["micro_batch_size"] == 0 and r["shard_weight"] == 0 for r in lossy["plan"]["ranks"])  # every GPU at work
    lossy_gain = lossy["samples_per_s"] / alone["chosen_samples_per_s"]
    assert exact_gain < 1 < lossy_gain
    assert (f"adding the last node: {exact_gain:.2f}x the throughput, each cluster with its fastest collectives, "
            f"{lossy_gain:.2f}x with lossy ones allowed: worth it at this link and batch only with lossy "
            "collectives") in out, out
    # the ranks left out, and why: against the fastest plan with every GPU, by the plans' own numbers
    assert whole["left_out"] == [4, 5, 6, 7]
    best = min(("flat", "hierarchical", "secondary_shards", "once_per_iteration"),
               key=lambda w: whole[w]["iteration_s"])

    def compute(plan: dict) -> float:
        return max(r["predicted_compute_s"] for r in plan["ranks"] if r["predicted_compute_s"] is not None)

    every = whole[best]
    chosen_s = 128 / whole["chosen_samples_per_s"]
    line = re.search(r"all nodes: ranks 4,5,6,7 \(node 1\) left out: in the step they would take ([\d.]+) s of compute "
                     r"off the others \(slowest rank ([\d.]+) s -> ([\d.]+) s\) and add ([\d.]+) s on the links "
                     r"\(([\d.]+) s -> ([\d.]+) s with the fastest way, " + best + r"\)", out)
    assert line, out
    taken, slowest_out, slowest_in, added, links_out, links_in = map(float, line.groups())
    assert slowest_in == pytest.approx(compute(every["plan"]), abs=0.005)
    assert links_in == pytest.approx(every["iteration_s"] - compute(every["plan"]), abs=0.005)
    assert slowest_out + links_out == pytest.approx(chosen_s, abs=0.01)
    assert taken == pytest.approx(slowest_out - slowest_in, abs=0.01) and added > taken  # why they are out
    assert not re.search(r"-[\d.]+% slower", out)
