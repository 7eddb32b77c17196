"""The sources read by index: any map-style dataset, in an order computed from the seed.

Runs wherever the pipeline runs. ``indexed`` is ``IndexedDataset`` and ``reshard`` its
state and how it moves to another layout; ``order`` places an epoch's positions over
ranks and workers, ``permutation`` computes the shuffled order position by position;
``sampled`` and ``lazy_order`` read a dataset in the order a user's sampler gives.
"""
