"""Hypothesis-generated loader configurations and save points (issue 2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipelines import RandomCounter

from savable_loader import SavableDataLoader
from savable_loader.testing import assert_resumes_exactly


@given(
    n=st.integers(0, 14),
    uneven=st.booleans(),
    batch_size=st.one_of(st.none(), st.integers(1, 4)),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    point_seed=st.integers(0, 1000),
)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_without_workers(n, uneven, batch_size, drop_last, seed, point_seed):
    drop_last = drop_last and batch_size is not None
    report = assert_resumes_exactly(
        lambda: SavableDataLoader(
            RandomCounter(n, uneven=uneven), batch_size=batch_size, drop_last=drop_last, seed=seed
        ),
        num_points=4,
        seed=point_seed,
        chain_items=(1,),
    )
    assert len(report.save_points) >= 5  # the boundaries at least


@pytest.mark.slow
@given(
    n=st.integers(0, 12),
    uneven=st.booleans(),
    num_workers=st.integers(1, 3),
    prefetch_factor=st.integers(1, 3),
    batch_size=st.one_of(st.none(), st.integers(1, 3)),
    drop_last=st.booleans(),
    point_seed=st.integers(0, 1000),
)
@settings(max_examples=6, suppress_health_check=[HealthCheck.too_slow])
def test_with_workers(n, uneven, num_workers, prefetch_factor, batch_size, drop_last, point_seed):
    drop_last = drop_last and batch_size is not None
    report = assert_resumes_exactly(
        lambda: SavableDataLoader(
            RandomCounter(n, uneven=uneven),
            batch_size=batch_size,
            drop_last=drop_last,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
        ),
        num_points=3,
        seed=point_seed,
        chain_items=(1,),
        boundaries=False,
        inline_chains=True,
    )
    assert len(report.save_points) >= min(3, sum(report.items_per_epoch))
