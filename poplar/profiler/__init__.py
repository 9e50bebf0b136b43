"""Profiler: device presets, virtual devices, capacity search and timing."""
