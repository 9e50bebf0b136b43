"""A measured exposure carried to collectives run another way (``types/profiles.py``'s Note: an
exposure carried): the smaller of it scaled and moved, none below zero."""

from __future__ import annotations

import numpy as np
import pytest

from poplar.types.profiles import Carry, Exposure, LedExposure


def test_the_smaller_bound_binds_and_nothing_goes_below_zero() -> None:
    half = Carry.between(1.0, 2.0)  # the new collectives take 1 s serially where the measured took 2 s
    assert half == Carry(0.5, 1.0)
    assert half.of(1.5) == pytest.approx(0.5)  # moved: compute still hides the 0.5 s it hid
    assert half.of(3.0) == pytest.approx(1.5)  # scaled: exposed past its serial seconds, the fraction binds
    assert half.of(0.4) == 0.0  # moved below zero
    assert list(half.of(np.array([1.5, 3.0, 0.4]))) == pytest.approx([0.5, 1.5, 0.0])
    dearer = Carry.between(3.0, 2.0)
    assert dearer.of(1.0) == pytest.approx(1.5)  # within its serial seconds: scaled (moved would be 2.0)
    assert Carry().of(0.7) == 0.7 and Carry.between(1.0, 0.0) == Carry()  # nothing measured: as it is
    fraction = Carry.between(1.0, 2.0, keep_seconds=False)  # quantized collectives: scaled alone
    assert fraction.of(1.5) == pytest.approx(0.75) and fraction.of(0.4) == pytest.approx(0.2)


def test_an_exposure_carries_every_value_but_the_overhead_and_scales_the_switch() -> None:
    x = Exposure(micro_step_s=1.5, iteration_s=3.0, step_s=(1.5, 0.4), end_s=(3.0,), switch_s=0.2, overhead_s=0.3,
                 leaders=(LedExposure("a", micro_step_s=1.5, iteration_s=3.0, micro_step_small_lead_s=0.4),))
    got = x.carried(Carry(0.5, 1.0), Carry(0.5, 1.0))
    assert (got.micro_step_s, got.iteration_s, *got.step_s, *got.end_s) == pytest.approx((0.5, 1.5, 0.5, 0.0, 1.5))
    assert got.switch_s == pytest.approx(0.1) and got.overhead_s == 0.3  # a difference scales; no collective stays
    lead, = got.leaders
    assert (lead.micro_step_s, lead.iteration_s, lead.micro_step_small_lead_s) == pytest.approx((0.5, 1.5, 0.0))
