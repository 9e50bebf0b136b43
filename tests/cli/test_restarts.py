"""Jobs that restart by themselves: under ``torchrun --max-restarts``, a worker killed mid-run
makes the job re-form its group, resume from the last complete checkpoint and finish with the
loss of an uninterrupted run; SIGKILL of the launcher leaves no worker behind, and the last
complete checkpoint loads."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poplar.emulation.torchrun_workers import worker_pid
from tests.cli.test_train_cli import CPU_ONLY, REPO, TORCHRUN, _config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **CPU_ONLY}
COLLECTIVE_TIMEOUT_S = 30
DEADLINE_S = 240.0
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc").is_dir(),
                                    reason="needs torchrun and /proc")


def _setup(tmp: Path, iterations: int) -> None:
    _config(tmp, iterations=iterations, log_every=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            checkpoint={"dir": "ckpt", "every": 5, "keep": 2})
    cfg = json.loads((tmp / "run.json").read_text())
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}  # SGD + momentum: wrong factors show
    cfg["train_batch_size"] = 16
    (tmp / "run.json").write_text(json.dumps(cfg))


def _launch(tmp: Path, log: Path, *torchrun_args: str) -> subprocess.Popen:
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node", "4", *torchrun_args, "-m", "poplar",
                             "train", "--config", "run.json"], cwd=tmp, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)


def _wait_for(text: str, log: Path, proc: subprocess.Popen, deadline: float) -> None:
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{text!r} did not appear (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _final_loss(tmp: Path) -> tuple[int, float]:
    metrics = json.loads((tmp / "report" / "metrics.json").read_text())
    return metrics["end_iteration"], metrics["losses"][-1]


@needs_torchrun
@pytest.mark.multiprocess
def test_a_killed_worker_restarts_the_job_which_resumes_and_ends_with_the_uninterrupted_loss(tmp_path: Path) -> None:
    iterations = 24
    reference, restarted = tmp_path / "reference", tmp_path / "restarted"
    reference.mkdir(), restarted.mkdir()
    _setup(reference, iterations), _setup(restarted, iterations)
    deadline = time.monotonic() + DEADLINE_S
    proc = _launch(reference, reference / "run.log")
    code = proc.wait(timeout=DEADLINE_S)
    assert code == 0, (reference / "run.log").read_text()[-3000:]

    log = restarted / "run.log"
    proc = _launch(restarted, log, "--max-restarts", "2")
    try:
        _wait_for(f"iteration 12/{iterations}", log, proc, deadline)
        victim = worker_pid(proc.pid, 2)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "rank 2 died (its process ended)" in text, text[-4000:]
    resumed = re.search(r"resumed from ckpt at iteration (\d+)", text)  # 10, or a later save the kill missed
    assert resumed and int(resumed.group(1)) in (10, 15, 20), text[-4000:]
    assert _final_loss(restarted) == _final_loss(reference)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@needs_torchrun
@pytest.mark.multiprocess
def test_sigkill_of_the_launcher_leaves_no_worker_and_the_last_checkpoint_loads(tmp_path: Path) -> None:
    _setup(tmp_path, 100_000)
    log = tmp_path / "run.log"
    proc = _launch(tmp_path, log)
    deadline = time.monotonic() + DEADLINE_S
    workers: list[int] = []
    try:
        _wait_for("iteration 7/100000", log, proc, deadline)
        workers = [worker_pid(proc.pid, r) for r in range(4)]
        assert None not in workers
        proc.kill()  # the launcher alone: torchrun gives each worker a session of its own
        killed = time.monotonic()
        while any(_alive(p) for p in workers) and time.monotonic() < killed + COLLECTIVE_TIMEOUT_S + 10:
            time.sleep(0.1)
        gone_s = time.monotonic() - killed
    finally:
        for p in workers:
            if p is not None and _alive(p):
                os.kill(p, signal.SIGKILL)
    text = log.read_text()
    assert gone_s < COLLECTIVE_TIMEOUT_S, (gone_s, text[-3000:])
    assert "the launcher (pid" in text and "is gone" in text, text[-3000:]
    pointer = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    stopped = pointer["iteration"]
    assert stopped >= 7 and f"stopped by SIGTERM at iteration {stopped}" in text, text[-3000:]
    again = subprocess.run([sys.executable, "-m", "poplar", "train", "--config", "run.json", "--iterations",
                            str(stopped + 1)], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from ckpt at iteration {stopped}" in again.stderr


# torchrun's rendezvous, shortened: once one agent is there it waits 3 s (not 30) for others, and a
# member that stopped beating is dropped after 5 x 1 s (not 3 x 5 s)
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"


def rendezvous_port() -> int:
    """A free port below the ephemeral range, for the rendezvous store.

    A port from ``free_port`` (the kernel's pick from the ephemeral range) is free when it is
    picked, and the store binds it seconds later, once torchrun has started. Meanwhile any test
    beside this one may be given it for a socket of its own: a gloo pair or another job's store.
    An agent that cannot bind the endpoint it believes it hosts then joins whatever listens there
    as a client (torch's c10d rendezvous falls back so), and when that store goes away both agents
    end with ``RendezvousConnectionError ... Failed to recv``. The kernel never hands out a port
    below the ephemeral range to a socket bound to port 0, and no test binds one by number.
    """
    for port in random.Random().sample(range(20000, 29000), 200):  # Linux's ephemeral range starts at 32768
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-29000")


def _elastic(tmp: Path, log: Path, port: int, conf: str = "") -> subprocess.Popen:
    """One agent of an elastic job of 1 to 2 agents (two agents on this machine stand for two nodes)."""
    return subprocess.Popen([str(TORCHRUN), "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts",
                             "2", "--rdzv-conf", RDZV_CONF + conf, "-m", "poplar", "train", "--config",
                             "run.json"], cwd=tmp, env=ENV, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            start_new_session=True)


def _lose_agent(agents: list[subprocess.Popen], logs: list[Path], lost: int) -> tuple[int, str]:
    """Run two agents until iteration 12 is logged, SIGKILL agent ``lost`` and its workers, and
    wait for the other: its exit status and log."""
    kept = 1 - lost
    deadline = time.monotonic() + DEADLINE_S
    pids: list[int | None] = []
    try:
        while "iteration 12/" not in logs[0].read_text() + logs[1].read_text():
            assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, \
                logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
            time.sleep(0.05)
        pids = [worker_pid(agents[lost].pid, r) for r in range(4)]
        for pid in [agents[lost].pid, *[p for p in pids if p is not None]]:
            os.kill(pid, signal.SIGKILL)
        code = agents[kept].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        for pid in pids:
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
    return code, logs[kept].read_text()


@needs_torchrun
@pytest.mark.multiprocess
def test_an_elastic_job_whose_store_runs_apart_survives_losing_its_first_agent(tmp_path: Path) -> None:
    """The way docs/checkpoints.md gives to survive the loss of any worker machine: the c10d store in a process of
    its own, every agent told it is not the host. The first agent (the store's host otherwise)
    dies, and the second goes on alone to the end."""
    _setup(tmp_path, 30)
    port = rendezvous_port()
    store = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore("
                              f"'127.0.0.1', {port}, is_master=True, wait_for_workers=False); time.sleep(600)"])
    try:
        listening = time.monotonic() + DEADLINE_S
        while True:  # the store listens once its process has imported torch
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                assert store.poll() is None and time.monotonic() < listening, "the store did not start"
                time.sleep(0.1)
        logs = [tmp_path / "first.log", tmp_path / "second.log"]
        first = _elastic(tmp_path, logs[0], port, ",is_host=false")
        time.sleep(1.0)  # the first agent is rank 0 of the first round
        second = _elastic(tmp_path, logs[1], port, ",is_host=false")
        code, text = _lose_agent([first, second], logs, lost=0)
    finally:
        store.kill()
        store.wait()
    assert code == 0, text[-4000:]
    resumed = re.search(r"resumed from ckpt at iteration (\d+): .*saved by 4 ranks", text)
    assert resumed and int(resumed.group(1)) >= 10, text[-4000:]
    assert "iteration 30/30" in text[resumed.start():]


@needs_torchrun
@pytest.mark.multiprocess
def test_an_elastic_job_that_loses_a_member_resumes_on_the_smaller_world_with_a_new_plan(tmp_path: Path) -> None:
    iterations = 30
    _setup(tmp_path, iterations)
    port = rendezvous_port()
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = _elastic(tmp_path, logs[0], port)
    time.sleep(1.0)  # the first agent hosts the rendezvous
    second = _elastic(tmp_path, logs[1], port)
    code, text = _lose_agent([first, second], logs, lost=1)  # the second node goes away
    assert "global batch 16" in text
    assert code == 0, text[-4000:]
    resumed = re.search(r"resumed from ckpt at iteration (\d+): .*saved by 4 ranks", text)
    assert resumed and int(resumed.group(1)) >= 10, text[-4000:]
    after = text[resumed.start():]
    assert f"iteration {iterations}/{iterations}" in after
    plan = text[text.rindex("plan (even"):resumed.start()]  # the plan of the smaller world
    assert re.search(r"\n +0 .* 8 +(none|optimizer)? *\n +1 .* 8 +(none|optimizer)? *\nglobal batch 16", plan), plan  # 8 samples each, not 4
    metrics = json.loads((tmp_path / "report" / "metrics.json").read_text())
    assert metrics["end_iteration"] == iterations and len(metrics["ranks"]) == 2
