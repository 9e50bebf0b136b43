"""Training on top of ``PoplarEngine``: the loop (``fit``), the plan-aware loader, the
``poplar train`` config, and the reports a run writes."""
