"""Errors shared across layers."""

from __future__ import annotations


class DistributedError(RuntimeError):
    """Raised on every rank when any rank reported a problem at an agreement point, or when a
    collective failed because a peer died or timed out."""


class PlanError(ValueError):
    """A plan that cannot be run, with the reason and the fix in its message."""


class ProfileError(ValueError):
    """A profile that cannot be used, with the reason and the fix in its message."""
