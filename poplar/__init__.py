"""Poplar: ZeRO data parallelism for clusters of mixed GPUs.

Every rank gets its own micro-batch size, accumulation steps and last-batch size, planned from
measured speed curves, while each optimizer step stays exactly the step of the whole global batch.
"""

from poplar.types.plans import Offload, Plan, PlanError, RankPlan
from poplar.types.profiles import CommProfile, Profile, ProfileError, ProfilePoint, RankProfile

__version__ = "0.1.0"

__all__ = [
    "Offload", "Plan", "PlanError", "RankPlan",
    "Profile", "ProfileError", "ProfilePoint", "RankProfile", "CommProfile",
    "PoplarEngine", "AutoOptions", "plan", "simulate", "profile",
    "fit", "Trainer", "FitConfig", "FitResult", "CheckpointOptions", "EvalOptions", "ReportOptions",
    "StepObserver", "MicroStep", "IterationStats",
    "MixedPrecision", "LossScaleConfig", "NonFinitePolicy", "ZeroConfig", "ProfileOptions",
    "Topology", "CommPolicy",
]

# Each feature adds its public names below (one import line per subpackage).
from poplar.auto import AutoOptions  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from poplar.planner import plan, simulate  # noqa: E402
from poplar.profiler import ProfileOptions, profile  # noqa: E402
from poplar.train import CheckpointOptions, EvalOptions, FitConfig, FitResult, ReportOptions, Trainer, fit  # noqa: E402
from poplar.types.precision import LossScaleConfig, MixedPrecision  # noqa: E402
from poplar.types.compression import CommPolicy  # noqa: E402
from poplar.types.topology import Topology  # noqa: E402
from poplar.zero.config import ZeroConfig  # noqa: E402
from poplar.zero.nonfinite import NonFinitePolicy  # noqa: E402
from poplar.zero.observers import IterationStats, MicroStep, StepObserver  # noqa: E402
