"""No silent choices: a plan that leaves ranks without samples is named in a warning, with the
global batch that would give every rank samples."""

from __future__ import annotations

from poplar.auto import AutoOptions
from poplar.auto.mode import idle_ranks_line
from poplar.emulation.presets import get_preset
from poplar.emulation.synthetic import profile_from_presets
from poplar.planner import plan as make_plan
from poplar.planner.planning import batch_using_every_rank

PROFILE = profile_from_presets([get_preset(n) for n in ("A100-80G", "A100-80G", "T4-16G", "T4-16G")], 2)


def uses_all(gbs: int) -> bool:
    return all(r.num_samples > 0 for r in make_plan(PROFILE, gbs, 2).ranks)


def test_the_smallest_batch_that_uses_every_rank() -> None:
    assert not uses_all(16)
    found = batch_using_every_rank(PROFILE, 16, 2)
    assert found is not None and found > 16 and uses_all(found) and not uses_all(found - 1), found
    assert batch_using_every_rank(PROFILE, 2, 2, tries=1) is None  # the search is bounded
    assert batch_using_every_rank(PROFILE, 2, 2) == found  # from a batch below the world size too


def test_the_warning_names_the_idle_ranks_and_the_batch() -> None:
    plan = make_plan(PROFILE, 16, 2)
    idle = [r for r, row in enumerate(plan.ranks) if row.num_samples == 0]
    assert idle == [2, 3]
    line = idle_ranks_line(PROFILE, plan, idle, AutoOptions())
    found = batch_using_every_rank(PROFILE, 16, 2)
    assert "ranks 2 (T4-16G), 3 (T4-16G) get 0 samples at global batch 16" in line, line
    assert f"a global batch of {found} would give every rank samples" in line and "require_all_ranks=True" in line
