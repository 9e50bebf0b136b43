"""What auto mode's profiling trains on: ``AutoOptions.profile_data``, a map-style dataset (its
first samples, cycled, collated) or ``sample_fn(b)`` returning a batch of ``b`` samples."""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import default_collate


class DatasetSamples:
    """``sample_fn(b)`` over a map-style dataset: its first ``b`` samples (cycled), collated."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any] | None = None) -> None:
        if len(dataset) < 1:
            raise ValueError("profile_data is an empty dataset; give one with samples")
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    def __call__(self, batch: int) -> Any:
        n = len(self.dataset)
        return self.collate_fn([self.dataset[i % n] for i in range(batch)])


def sample_fn_of(profile_data: Any, collate_fn: Callable[[list], Any] | None = None) -> Callable[[int], Any]:
    if callable(profile_data) and not hasattr(profile_data, "__getitem__"):
        return profile_data
    if hasattr(profile_data, "__len__") and hasattr(profile_data, "__getitem__"):
        return DatasetSamples(profile_data, collate_fn)
    raise ValueError("auto mode needs profile_data: a map-style dataset or sample_fn(b) returning a batch of b "
                     f"samples, got {type(profile_data).__name__}")
