"""Data types and their files: plans, profiles, cluster specs and device presets, batches,
errors, logging. Everything else in Poplar builds on these; they depend on nothing of Poplar's."""
