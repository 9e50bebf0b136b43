"""Speed curves: samples/s (and seconds per micro-step) of one device type at every batch 1..mbs.

A curve is built from the profiled points (batch, compute seconds) of all ranks of one device
type: the median time per profiled batch, speed = batch / seconds, interpolated by a cubic
spline and evaluated at every integer batch. The planner only ever reads the integer table.

Choices (measured on the preset curves, speed = peak * b / (b + half_batch) with a fixed
overhead, profiled at powers of two plus mbs):
- the spline runs over log2(batch), not batch: profile points sit at powers of two, so they are
  evenly spaced in log2 and the spline has no long, under-determined last interval. Max relative
  speed error 0.03-0.15 % in log2 vs 0.15-1.2 % over batch;
- ``not-a-knot`` end conditions, not ``natural``: a natural spline forces zero curvature at
  batch 1, where the real curve bends most (the steep rise); not-a-knot lets the first two
  intervals share one cubic and follows the data (0.03-0.08 % vs 0.08-0.15 % error in log2).
Robustness: 1 point -> constant speed; 2 points -> linear; outside the profiled range time is
extended linearly (below) or at constant speed (above) rather than by the cubic; spline speeds
are clipped to [half the slowest, the fastest] measured speed so a wiggle cannot invent a peak.
Finally the time table is made non-decreasing (time(b) = max over b' <= b): more samples are
never predicted to take less time. That keeps "largest batch whose time <= t" well defined and
lets the allocators be exact; where a raw spline dipped, the table is the pessimistic envelope.

[Note: an mbs between measured batches]
A rank's mbs can fall after profiling, below batches it was timed at: a subset's ranks hold more of
the sharded state (``participation.on_ranks``), a shard weight gives a rank a larger shard
(``shards.with_mbs``). The points past the new mbs move to ``points_past_mbs``
(``RankProfile.at_mbs``): they no longer fit, but they are still that device's compute at those
batches (the compute of a micro-step does not depend on how the state around it is sharded). Where
the mbs itself was not measured, the curve takes the nearest of them into its fit (``from_points``'
``above``), so the time at the mbs is interpolated between measured batches, as any batch between
two measured ones is, and never evaluated past mbs. Without it, an mbs of 7 cut from a profile
timed at 6 and 8 was extended from 6 at constant speed: a preset's micro-step of 7 priced 6 % slow,
where the spline through 6 and 8 is within 0.2 % (docs/experiments.md, 2026-11-30). Where the mbs
was measured nothing past it is used, so a profile's own curves are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from poplar.types.profiles import ProfileError


@dataclass
class SpeedCurve:
    """Seconds per micro-step at every batch 1..mbs for one device type.

    ``times[b - 1]`` is the predicted compute time of a micro-step of ``b`` samples; it is
    non-decreasing in ``b``. ``time(0)`` is 0 (a rank with nothing to do).
    """

    device_type: str
    times: np.ndarray
    points: list[tuple[int, float]] = field(default_factory=list)  # (batch, median seconds) used

    def __post_init__(self) -> None:
        t = np.asarray(self.times, dtype=float)
        if t.ndim != 1 or t.size < 1 or not np.all(np.isfinite(t)) or np.any(t <= 0):
            raise ProfileError(f"{self.device_type}: a speed curve needs positive finite times for batches 1..mbs")
        self.times = np.maximum.accumulate(t)
        self._times0 = np.concatenate(([0.0], self.times))  # index by batch, time(0) = 0

    @property
    def mbs(self) -> int:
        return int(self.times.size)

    def time(self, batch: int) -> float:
        """Seconds for one micro-step of ``batch`` samples (0 for batch 0)."""
        if batch < 0 or batch > self.mbs:
            raise ValueError(f"{self.device_type}: batch {batch} outside 0..mbs={self.mbs}")
        return float(self._times0[batch])

    def times_of(self, batches: np.ndarray) -> np.ndarray:
        """Vectorised ``time``: batches in 0..mbs."""
        return self._times0[np.asarray(batches, dtype=np.int64)]

    @property
    def speeds(self) -> np.ndarray:
        """Samples/s at batches 1..mbs."""
        return np.arange(1, self.mbs + 1) / self.times

    def speed(self, batch: int) -> float:
        return batch / self.time(batch)

    @property
    def peak_batch(self) -> int:
        """The batch (1..mbs) with the highest speed; the smallest such batch on ties."""
        return int(np.argmax(self.speeds)) + 1

    @property
    def peak_speed(self) -> float:
        return float(self.speeds.max())

    def max_batch_within(self, seconds: float | np.ndarray) -> int | np.ndarray:
        """Largest batch whose time is <= ``seconds`` (0 if even batch 1 is slower)."""
        out = np.searchsorted(self.times, seconds, side="right")
        return int(out) if np.ndim(out) == 0 else out

    @classmethod
    def from_points(cls, device_type: str, mbs: int, points: Sequence[tuple[int, float]],
                    above: Sequence[tuple[int, float]] = ()) -> "SpeedCurve":
        """Build a curve from (batch, seconds) points; several points per batch are merged by
        median. ``above``: points timed at batches past ``mbs`` (``points_past_mbs``); where
        ``mbs`` itself was not measured, the nearest of them joins the fit (Note: an mbs between
        measured batches)."""
        if mbs < 1:
            raise ProfileError(f"{device_type}: mbs must be >= 1, got {mbs}")
        try:
            arr = np.asarray(points, dtype=float).reshape(-1, 2)
        except (TypeError, ValueError):
            raise ProfileError(f"{device_type}: profiled points must be (batch, seconds) numbers") from None
        batch, secs = arr[:, 0], arr[:, 1]
        bad = ~np.isfinite(batch) | (batch < 1) | (batch != np.floor(batch))
        if bad.any():
            raise ProfileError(f"{device_type}: bad profiled batch {batch[bad][0]!r}; batches are integers >= 1")
        bad = ~np.isfinite(secs) | ~(secs > 0)
        if bad.any():
            raise ProfileError(f"{device_type}: bad time {secs[bad][0]!r} at batch {int(batch[bad][0])}; "
                               "need a finite time > 0")
        keep = batch <= mbs
        if not keep.any():
            raise ProfileError(f"{device_type}: no profiled point at a batch <= mbs={mbs}; re-run the profiler")
        batch, secs = batch[keep], secs[keep]
        xs = np.unique(batch)
        ts = np.array([float(np.median(secs[batch == x])) for x in xs])
        past = [(int(b), float(t)) for b, t in above if b > mbs and t > 0]
        if xs[-1] < mbs and past:  # the mbs lies between measured batches: interpolate to it
            nearest = min(b for b, _ in past)
            xs = np.append(xs, nearest)
            ts = np.append(ts, float(np.median([t for b, t in past if b == nearest])))
        return cls(device_type, _interpolate(xs, ts, mbs), [(int(b), float(t)) for b, t in zip(xs, ts)])


def _interpolate(xs: np.ndarray, ts: np.ndarray, mbs: int) -> np.ndarray:
    """Time at batches 1..mbs from sorted points (xs batches, ts seconds)."""
    batches = np.arange(1, mbs + 1, dtype=float)
    speeds_pts = xs / ts
    if xs.size == 1:
        return batches / speeds_pts[0]
    if xs.size == 2:
        speed = np.interp(batches, xs, speeds_pts)
    else:
        # imported on the first fit, not with the planner: scipy.interpolate is about 0.35 s of
        # every process's start (a third of `import poplar` beyond torch), and most processes fit
        # no curve (ranks given a plan, the command line's --help)
        from scipy.interpolate import CubicSpline

        spline = CubicSpline(np.log2(xs), speeds_pts, bc_type="not-a-knot")
        speed = spline(np.log2(batches))
    speed = np.clip(speed, 0.5 * speeds_pts.min(), speeds_pts.max())
    times = batches / speed
    lo, hi = xs[0], xs[-1]
    below = batches < lo
    if below.any():  # time ~ affine in batch at small batches: extend the first segment
        slope = (ts[1] - ts[0]) / (xs[1] - xs[0])
        lin = ts[0] + slope * (batches[below] - lo)
        times[below] = np.clip(lin, batches[below] * ts[0] / lo, ts[0])
    above = batches > hi
    if above.any():  # no data: assume the last measured speed holds
        times[above] = batches[above] * ts[-1] / hi
    exact = np.searchsorted(xs, batches)
    hit = (exact < xs.size) & (xs[np.minimum(exact, xs.size - 1)] == batches)
    times[hit] = ts[exact[hit]]  # measured points are kept exactly
    return times
