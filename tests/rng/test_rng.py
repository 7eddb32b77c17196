"""Generator capture: the fast paths agree with the public functions."""

from __future__ import annotations

import random

import numpy as np
import torch

from savable_loader import rng


def _draws():
    return (
        [random.random() for _ in range(700)],
        random.gauss(0, 1),
        np.random.rand(5).tolist(),
        float(np.random.standard_normal()),
        torch.rand(3).tolist(),
    )


def test_capture_and_apply_reproduce_all_three_generators():
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    random.gauss(0, 1)
    np.random.standard_normal()  # leaves a cached Gaussian behind
    snapshot = rng.capture()
    first = _draws()
    rng.apply(snapshot)
    assert _draws() == first
    rng.apply(rng.RngSnapshot.from_state(snapshot.to_state()))
    assert _draws() == first


def test_saved_state_matches_the_public_getstate():
    random.seed(5)
    np.random.seed(5)
    random.random()
    np.random.standard_normal()
    state = rng.capture().to_state()
    words = np.frombuffer(state.python, dtype="<u4").tolist()
    assert tuple(words) == random.getstate()[1]
    _, key, pos, has_gauss, gauss = np.random.get_state()
    assert np.frombuffer(state.numpy_key, dtype="<u4").tolist() == key.tolist()
    assert (state.numpy_pos, state.numpy_has_gauss, state.numpy_gauss) == (pos, has_gauss, gauss)
    assert state.torch == torch.get_rng_state().numpy().tobytes()


def test_fast_paths_are_in_use_on_this_platform():
    assert rng.generators._PYTHON._offset is not None
    assert rng.generators._NUMPY._offsets is not None


def test_derived_seeds_differ_by_rank_and_worker_and_are_stable():
    seeds = {rng.derive_seed(0, rank, worker) for rank in range(4) for worker in range(8)}
    assert len(seeds) == 32
    assert rng.derive_seed(0, 1, 2) == rng.derive_seed(0, 1, 2)
    assert rng.derive_seed(0, 1, 2) != rng.derive_seed(1, 1, 2)


def test_the_loader_seeds_torchs_cpu_generator_as_manual_seed_does_and_no_accelerator(
    monkeypatch,
):
    """``seed_globals`` leaves the CPU generator where ``torch.manual_seed`` would, and
    seeds no accelerator: torch's DataLoader never touches the main process's CUDA
    generator, and ``torch.manual_seed`` queues each accelerator's seeding with a stack
    trace (milliseconds per worker start)."""
    from savable_loader import SavableDataLoader
    from savable_loader.rng.generators import seed_globals

    seed_globals(1234)
    ours = torch.get_rng_state()
    torch.manual_seed(1234)
    assert torch.equal(ours, torch.get_rng_state())
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", calls.append)
    seed_globals(1234)
    list(SavableDataLoader(torch.arange(6.0), batch_size=2, shuffle=True, seed=3))
    assert calls == []
