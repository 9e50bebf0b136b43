"""Training on top of ``PoplarEngine``: the loop (``Trainer``, and ``fit`` its functional door)
with its policies (``poplar.train.options``), the plan-aware loader, the ``poplar train``
config, and the reports a run writes."""

from poplar.train.data import LoaderOptions, PlanLoader
from poplar.train.options import CheckpointOptions, EvalOptions, FitConfig, ReportOptions, ThroughputOptions
from poplar.train.records import FitResult
from poplar.train.replan import ReplanOptions
from poplar.train.schedule import LRSchedule
from poplar.train.trainer import Trainer, fit

__all__ = ["Trainer", "fit", "FitConfig", "FitResult", "CheckpointOptions", "EvalOptions", "ReportOptions",
           "ThroughputOptions", "LoaderOptions", "ReplanOptions", "LRSchedule", "PlanLoader"]
