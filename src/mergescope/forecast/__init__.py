"""The merge forecast: which pre-merge diagnostics predict what a merge does, validated on merges it has not seen.

The benchmark is the experiment's own native merges of checkpoint pairs (:mod:`~mergescope.forecast.table`), the model
a sparse linear one on standardised data-free diagnostics (:mod:`~mergescope.forecast.fit`), the task
``task=forecast`` (:mod:`~mergescope.forecast.job`), the report's section "What predicts a merge"
(:mod:`~mergescope.forecast.report`); ``study=forecast`` builds the benchmark and runs it.
"""
