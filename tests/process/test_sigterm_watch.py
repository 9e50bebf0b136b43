"""A rank that leaves on SIGTERM while blocked says so in one line, unless a failing rank has
already checked in: then the job's one failure line is that rank's, and it names this one."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LEAVE = """
import sys
from poplar.process.sigterm_watch import SigtermWatch

class Board:
    def reported(self):
        return {reported}
    def finish(self):
        pass

SigtermWatch("poplar train")._leave(Board(), 20.0)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("reported, lines", [(False, 1), (True, 0)])
def test_a_blocked_rank_leaving_on_sigterm_is_quiet_once_the_failure_is_reported(reported: bool, lines: int) -> None:
    out = subprocess.run([sys.executable, "-c", LEAVE.format(reported=reported)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 128 + 15, out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("poplar train: ")]
    assert len(said) == lines, out.stderr
