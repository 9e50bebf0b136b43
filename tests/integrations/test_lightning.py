"""PoplarStrategy: Lightning training equals one process on the whole global batch (3 gloo ranks,
an uneven plan, SGD with momentum), and resumes exactly from its own checkpoints."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from poplar.comm.launch import spawn  # noqa: E402
from tests import toy  # noqa: E402
from tests.integrations import lightning_jobs as jobs  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_three_steps_equal_one_process(zero_stage: int) -> None:
    out = spawn(jobs.fit_rank, 3, (zero_stage, 3, None, None, None), timeout_s=240, collective_timeout_s=120)
    assert toy.max_rel_err(out[0], jobs.reference(3)) < 1e-5
