"""One small adapter per loader, all with the same interface.

``ADAPTERS[name].build(workload, batch_size=..., num_workers=..., prefetch_factor=...)``
returns an adapter owning one loader over ``PeerDataset(workload)``; ``adapter.iterator()``
starts (or continues) its stream, ``adapter.save()`` returns the loader's state object
as the loader's own API returns it, ``adapter.restore(state)`` puts a state into a
freshly built adapter before its first ``iterator()``, ``adapter.state_size(state)`` is
the state's size in bytes and ``adapter.close()`` stops the workers.

NOTE [ State size ]
Each state is measured in the form its loader documents for checkpoints: ours as the
bytes of a state file (msgpack behind a checked header, what ``loader.state_dict()``
holds); torchdata's ``state_dict()`` and Energon's ``save_state_rank()`` are Python
objects that users pass to ``torch.save``, measured as ``len(pickle.dumps(state))`` in
memory (nothing is written or loaded). The three encodings differ, so sizes compare to
within the encoding overhead, not byte for byte.

NOTE [ Loader settings ]
Every loader gets the same batch size, workers and prefetch factor, persistent workers,
and a fixed seed (torch and torchdata: ``generator=torch.Generator().manual_seed(0)``;
ours: ``seed=0``; Energon: its ``WorkerConfig`` seeds), so that two runs of one loader
yield the same stream. Everything else is each loader's default, as a user would run
it: torchdata checkpoints every ``snapshot_every_n_steps`` batches (1 by default);
Energon checkpoints every ``checkpoint_every_sec=60`` seconds (at least
``2 * num_workers`` items apart) and keeps ``prefetch_factor * num_workers + 1``
checkpoints; ours checkpoints by measured cost.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader, default_collate

from peers.workloads import PeerDataset, Workload
from savable_loader import SavableDataLoader, serialization

# Energon asks torch for pinned memory, which a CPU-only machine cannot give.
warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator is found")

try:  # Megatron-Energon is optional: the comparison reports it as unavailable without it.
    import megatron.energon as energon

    ENERGON_ERROR: str | None = None
except Exception as error:  # ImportError, or anything its import raises on this machine
    energon = None
    ENERGON_ERROR = f"{type(error).__name__}: {error}"


class Adapter:
    """A loader behind the comparison's interface (see the module docstring)."""

    name: ClassVar[str]
    savable: ClassVar[bool] = True

    def __init__(self, loader: Any, batch_size: int) -> None:
        self.loader = loader
        self.batch_size = batch_size
        self._iterator: Iterator[Any] | None = None

    @classmethod
    def build(
        cls, workload: Workload, *, batch_size: int, num_workers: int, prefetch_factor: int = 2
    ) -> Adapter:
        raise NotImplementedError

    def iterator(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        return self._iterator

    def save(self) -> Any:
        raise NotImplementedError(f"{self.name} cannot save its position")

    def restore(self, state: Any) -> None:
        raise NotImplementedError(f"{self.name} cannot restore a position")

    def state_size(self, state: Any) -> int:
        return len(pickle.dumps(state))

    def close(self) -> None:
        """Stops the workers now, not whenever the garbage collector gets to them."""
        # torch keeps the persistent iterator in the private ``_iterator`` (Energon and
        # torchdata inherit that); shutting it down joins the workers.
        iterator = getattr(self.loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


class TorchAdapter(Adapter):
    """torch's ``DataLoader``: the throughput baseline; it cannot save."""

    name = "torch DataLoader"
    savable = False

    @classmethod
    def build(
        cls, workload: Workload, *, batch_size: int, num_workers: int, prefetch_factor: int = 2
    ) -> Adapter:
        loader = DataLoader(
            PeerDataset(workload),
            batch_size=batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(0),
        )
        return cls(loader, batch_size)


class TorchdataAdapter(Adapter):
    """torchdata's ``StatefulDataLoader`` with a given ``snapshot_every_n_steps``."""

    snapshot_every: ClassVar[int]

    @classmethod
    def build(
        cls, workload: Workload, *, batch_size: int, num_workers: int, prefetch_factor: int = 2
    ) -> Adapter:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            PeerDataset(workload),
            batch_size=batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(0),
            snapshot_every_n_steps=cls.snapshot_every,
        )
        return cls(loader, batch_size)

    def save(self) -> Any:
        return self.loader.state_dict()

    def restore(self, state: Any) -> None:
        self.loader.load_state_dict(state)


class Torchdata1Adapter(TorchdataAdapter):
    name = "torchdata, snapshot every 1"
    snapshot_every = 1


class Torchdata64Adapter(TorchdataAdapter):
    name = "torchdata, snapshot every 64"
    snapshot_every = 64


class OursAdapter(Adapter):
    """savable_loader's ``SavableDataLoader``."""

    name = "savable_loader"

    @classmethod
    def build(
        cls, workload: Workload, *, batch_size: int, num_workers: int, prefetch_factor: int = 2
    ) -> Adapter:
        loader = SavableDataLoader(
            PeerDataset(workload),
            batch_size=batch_size,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            seed=0,
        )
        return cls(loader, batch_size)

    def save(self) -> Any:
        return self.loader.save_state_rank()

    def restore(self, state: Any) -> None:
        self.loader.restore_state_rank(state)

    def state_size(self, state: Any) -> int:
        return len(serialization.dumps(state.to_plain()))

    def close(self) -> None:
        self.loader.close()
        self._iterator = None


def _energon_dataset_class() -> type:
    """Energon's ``SavableDataset`` around :meth:`Workload.item` (NOTE [ One dataset for
    every loader ] in ``workloads.py``): shards by Energon's worker ids, saves ``pos``."""

    class EnergonPeerDataset(energon.SavableDataset):  # type: ignore[misc, name-defined]
        _savable_fields = ("pos",)

        def __init__(self, worker_config: Any, workload: Workload) -> None:
            super().__init__(worker_config)
            self.workload = workload
            self.pos = 0

        def len_worker(self, worker_idx: int | None = None) -> int:
            return 2**62  # endless

        def reset_state_own(self) -> None:
            self.pos = 0

        def worker_has_samples(self) -> bool:
            return True

        def config(self) -> dict[str, Any]:
            return {"type": "EnergonPeerDataset", "workload": self.workload.config()}

        def __iter__(self) -> Iterator[dict[str, Any]]:
            worker = self.worker_config.rank_worker_id()
            workers = max(self.worker_config.num_workers, 1)
            while True:
                index = self.pos * workers + worker
                self.pos += 1
                yield self.workload.item(index)

    return EnergonPeerDataset


class EnergonAdapter(Adapter):
    """Megatron-Energon's ``SavableDataLoader`` with its defaults."""

    name = "Megatron-Energon"
    _dataset_class: ClassVar[type | None] = None

    @classmethod
    def build(
        cls, workload: Workload, *, batch_size: int, num_workers: int, prefetch_factor: int = 2
    ) -> Adapter:
        if energon is None:
            raise RuntimeError(f"Megatron-Energon is not available: {ENERGON_ERROR}")
        if cls._dataset_class is None:
            cls._dataset_class = _energon_dataset_class()
        config = energon.WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
        dataset = energon.BatchDataset(
            cls._dataset_class(config, workload),
            batch_size=batch_size,
            batcher=default_collate,
            worker_config=config,
        )
        loader = energon.SavableDataLoader(dataset, prefetch_factor=prefetch_factor)
        return cls(loader, batch_size)

    def save(self) -> Any:
        return self.loader.save_state_rank()

    def restore(self, state: Any) -> None:
        self.loader.restore_state_rank(state)


ADAPTERS: dict[str, type[Adapter]] = {
    "torch": TorchAdapter,
    "torchdata_1": Torchdata1Adapter,
    "torchdata_64": Torchdata64Adapter,
    "energon": EnergonAdapter,
    "ours": OursAdapter,
}


def available() -> dict[str, type[Adapter]]:
    """The adapters whose loader is installed here (Energon is optional)."""
    return {key: cls for key, cls in ADAPTERS.items() if key != "energon" or energon is not None}
