"""The run's pictures (optional matplotlib extra: ``pip install 'poplar[plot]'``); each writer
returns False, writing nothing, when matplotlib is missing.

- ``curves.png``: each device type's measured speeds and spline, titled with the model, the
  cluster, the stage, the precision, the plan's strategy and, for an emulated cluster, that its
  speeds follow the machine's load (``emulated_note``); each type's largest micro-batch (mbs, a
  triangle) and the plan's micro-batch b (a dotted line), and, below the axes, why a type runs
  below its best batch, in the terms of the plan's strategy (``below_best``).
- ``loss.png``: training loss per iteration and held-out loss at each evaluation.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

from poplar.types.plans import Plan, RankPlan
from poplar.types.profiles import Profile


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def cluster_name(profile: Profile) -> str:
    """"2 x V100-16G + 2 x T4-16G" (with the emulated cluster's name where the profile has one)."""
    types = [r.device_type for r in profile.ranks]
    mix = " + ".join(f"{types.count(t)} x {t}" for t in dict.fromkeys(types))
    emulated = profile.provenance.emulated
    name = emulated.cluster if emulated is not None else None
    return f"cluster {name} ({mix})" if name else mix


def below_best(curve: Any, row: RankPlan, plan: Plan) -> str | None:
    """Why a rank of this type runs micro-batches below its type's best batch, in the terms of
    the plan's strategy (None if it does not)."""
    b, best = row.micro_batch_size or row.last_batch_size, curve.peak_batch
    if b >= best or b < 1:
        return None
    head = f"{row.device_type}: b={b} < best {best}:"
    loss = f"({1 - curve.speed(b) / curve.peak_speed:.0%} below its best speed)"
    if plan.strategy == "even" and row.num_samples < best:
        return (f"{head} the even plan gives every rank an equal share of the global batch "
                f"{plan.global_batch_size}, {row.num_samples} samples per iteration {loss}")
    if plan.strategy == "even":
        return f"{head} the even plan runs every rank at the largest micro-batch of the smallest GPU {loss}"
    if plan.strategy == "flops":
        return (f"{head} the flops plan shares the global batch by nominal TFLOPS ({row.num_samples} samples "
                f"per iteration here) {loss}")
    if row.num_samples < best:
        return (f"{head} its share of the global batch {plan.global_batch_size} is {row.num_samples} samples per "
                f"iteration, so that it ends with the others {loss}")
    return (f"{head} its {row.num_samples} samples split as {row.accum_steps} x {b} + {row.last_batch_size}, "
            f"the split with the shortest predicted iteration {loss}")


def emulated_note(profile: Profile) -> str | None:
    """What an emulated profile's speeds are (None for real devices): the emulator stretches the
    CPU's compute to each GPU's speed, so every measured point also follows how busy the machine
    was; two runs of the same emulated GPU may differ by the machine's load, not by the GPU."""
    emulated = profile.provenance.emulated
    if emulated is None:
        return None
    return ("computed from presets, not measured" if emulated.synthetic
            else "emulated on a CPU: speeds follow the machine's load")


def curves_title(profile: Profile, plan: Plan | None = None) -> str:
    """``curves.png``'s title: model, cluster, stage, precision, the plan's strategy, and for an
    emulated cluster what its speeds are."""
    ckpt = " + activation checkpointing" if profile.activation_checkpointing else ""
    stage = plan.zero_stage if plan is not None else profile.zero_stage
    strategy = f", {plan.strategy or 'given'} plan" if plan is not None else ""
    emulated = emulated_note(profile)
    return (f"{profile.model_name or 'model'} on {cluster_name(profile)}\nZeRO-{stage}{ckpt}, {profile.precision}"
            f"{strategy}" + (f"\n{emulated}" if emulated else ""))


def write_curves_png(path: str | os.PathLike, profile: Profile, plan: Plan | None = None) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    from poplar.planner.curves import SpeedCurve

    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    rows = {r.device_type: r for r in plan.ranks} if plan is not None else {}
    notes = []
    for dtype in profile.device_types():
        members = [r for r in profile.ranks if r.device_type == dtype]
        points = [(p.batch, p.compute_s) for r in members for p in r.points]
        curve = SpeedCurve.from_points(dtype, min(r.mbs for r in members), points)
        line, = ax.plot(range(1, curve.mbs + 1), curve.speeds, label=f"{dtype} spline")
        color = line.get_color()
        ax.scatter([b for b, _ in points], [b / t for b, t in points], color=color, s=18, label=f"{dtype} measured" + (" (emulated)" if emulated_note(profile) else ""))
        ax.scatter([curve.mbs], [curve.speed(curve.mbs)], marker="^", s=60, color=color, edgecolors="black",
                   zorder=3)
        ax.annotate(f"mbs={curve.mbs}", (curve.mbs, curve.speed(curve.mbs)), textcoords="offset points",
                    xytext=(-10, 8), fontsize=8, color=color)
        row = rows.get(dtype)
        b = (row.micro_batch_size or row.last_batch_size) if row is not None else 0
        if row is not None and b:
            ax.axvline(b, color=color, linestyle=":", linewidth=1)
            ax.annotate(f"b={b}", (b, curve.speed(b)), textcoords="offset points", xytext=(4, -12), fontsize=8,
                        color=color)
            note = below_best(curve, row, plan) if plan is not None else None
            if note:
                notes.append(note)
    ax.set_xlabel("micro-batch size (triangle: largest that fits, mbs; dotted: the plan's b)")
    ax.set_ylabel("samples / s")
    ax.set_title(curves_title(profile, plan), fontsize=10)
    ax.legend(fontsize=7)
    if notes:
        text = "\n".join(textwrap.fill(n, 110) for n in notes)
        fig.text(0.01, 0.01, text, fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.04 + 0.035 * text.count("\n") + 0.035, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_loss_png(path: str | os.PathLike, metrics: dict[str, Any], title: str = "") -> bool:
    """Training loss per iteration and held-out loss at each evaluation, from ``metrics.json``'s
    fields (``iterations``, ``evals``)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    its = metrics.get("iterations") or []
    ax.plot([r["iteration"] + 1 for r in its], [r["loss"] for r in its], label="train loss", linewidth=1)
    evals = [e for e in metrics.get("evals") or [] if e.get("loss") is not None]
    if evals:
        ax.plot([e["iteration"] for e in evals], [e["loss"] for e in evals], "o-", label="eval loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title(title or "loss", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
