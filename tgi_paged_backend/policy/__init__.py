"""Preemption and admission policies: small pure functions, no state beyond a rate calibrator.

- ``admission``: the watermark brake and the ``CachedBatch`` token figures that enforce it.
- ``victims``: which running request to preempt (and which preempted one to resume) first.
- ``preemption_mode``: swap vs recompute from a calibrated cost model.
"""
