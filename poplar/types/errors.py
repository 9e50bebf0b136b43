"""Errors shared across layers."""

from __future__ import annotations


class DistributedError(RuntimeError):
    """Raised on every rank when any rank reported a problem at an agreement point, or when a
    collective failed because a peer died or timed out."""
