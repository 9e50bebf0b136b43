"""Auto mode: profile every rank's device inside the job, choose the configuration, plan
(``mode``: ``auto_plan``, which ``PoplarEngine`` calls; ``choice``: the fastest configuration)."""

from poplar.auto.mode import AutoOptions, AutoResult, Remedies, auto_plan, clone_optimizer
from poplar.auto.samples import DatasetSamples, sample_fn_of

__all__ = ["AutoOptions", "AutoResult", "DatasetSamples", "Remedies", "auto_plan", "clone_optimizer", "sample_fn_of"]
