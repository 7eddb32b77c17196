"""``SavableDataLoader``: torch's ``DataLoader`` whose position can be saved and restored.

The public face: it turns its arguments into a pipeline (``as_stage``, then ``Batch``),
runs it through torch's ``DataLoader`` over the worker wrapper, keeps the bookkeeping of
what it handed on (``_main/book.py``), and saves and restores it. The workers' runtime is
``_worker/runtime.py``, one run of the workers ``_main/stream.py``, state compatibility
``_resume/compat.py``. The stream's lifecycle (epochs, workers per epoch, errors) is described in
``_main/iterator.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar

from torch.utils.data import DataLoader

from . import distributed
from ._channel import torch_compat as _torch_compat
from ._channel.events import END, ERROR, PLACEHOLDER
from ._main.arguments import check_arguments
from ._main.book import Book
from ._main.iterator import LengthCheck, LoaderIterator
from ._main.pipeline import base_seed_generator, build_pipeline
from ._main.shown import PicklesOwnGenerators, shown_arguments, torch_arguments
from ._main.stops import StreamStops
from ._main.stream import Hang, Stream
from ._resume import elastic as _elastic
from ._resume.compat import SavedStates, check_compatible, own_state, state_from_dict, state_key
from ._resume.layout import Layout
from ._worker.runtime import RuntimeSpec
from ._worker.wrapper import WorkerWrapper
from .config import WorkerConfig
from .datasets.adapters.datapipes import is_datapipe, seed_epoch
from .errors import SavableLoaderError
from .state.files import encode_state
from .state.models import Checkpoint, RankState, one_save

__all__ = ["SavableDataLoader"]

#: What the loader yields: ``SavableDataLoader[T]`` as ``DataLoader[T]``.
T_co = TypeVar("T_co", covariant=True)


class SavableDataLoader(
    distributed.GlobalStates, StreamStops, PicklesOwnGenerators, DataLoader[T_co]
):
    """A ``DataLoader`` whose position in the data stream can be saved and restored exactly.

    Arguments keep ``DataLoader``'s names and defaults where they apply. Batching
    (``batch_size``, ``collate_fn``, ``drop_last``) happens inside the workers, so one batch
    never mixes workers.

    Args:
        dataset: A :class:`~savable_loader.SavableDataset`, a building block of
            :mod:`savable_loader.datasets`, an iterable with ``state_dict()``/
            ``load_state_dict()``, or a map-style dataset (``__getitem__`` + ``__len__``),
            served through :class:`~savable_loader.datasets.IndexedDataset`. Any other
            ``IterableDataset`` iterates as with torch, but saving raises
            :class:`~savable_loader.UnsavableDatasetError`.
        batch_size: Items per batch; None yields items one by one.
        shuffle: For map-style datasets: a new permutation every epoch, drawn from
            ``seed`` (from ``generator`` as torch does, when one is given).
        sampler: As in ``DataLoader`` (map-style datasets): drawn in the main process each
            epoch, saved as the generators it draws from (NOTE [ Epoch orders ]).
        batch_sampler: As in ``DataLoader``, likewise. The loader's attributes show them as
            torch's do (NOTE [ What the loader shows of its arguments ] in ``_main/shown.py``).
        num_workers: Worker processes; 0 runs the pipeline in the main process.
        collate_fn: Merges items into a batch (default: torch's ``default_collate``).
        pin_memory: As in ``DataLoader``.
        drop_last: Drop each worker's last incomplete batch of an epoch.
        timeout: As in ``DataLoader``.
        worker_init_fn: As in ``DataLoader`` (``get_worker_info().dataset`` is this
            worker's copy of ``dataset``; what it raises arrives as torch raises it); runs
            before the pipeline is restored.
        multiprocessing_context: As in ``DataLoader`` (fork, forkserver, spawn).
        generator: As in ``DataLoader``: drives ``shuffle=True`` (torch's ``RandomSampler``)
            and the workers' base seeds; its state is part of the saved state.
        prefetch_factor: As in ``DataLoader``.
        persistent_workers: As in ``DataLoader``: False (the default) starts the workers
            anew every epoch (NOTE [ Workers per epoch ]).
        pin_memory_device: As in ``DataLoader``.
        in_order: Must be True with workers: out-of-order delivery cannot be resumed.
        seed: Drives the shuffle order and the workers' seeds (with rank and worker id)
            when no ``generator`` is given.
        seed_each_item: Seed ``random``, ``numpy.random`` and torch's generator before each
            item from ``seed``, the epoch and the item's place in the global stream, so
            that a ``__getitem__`` or a map's function that draws from them draws the same
            on any number of ranks and workers (NOTE [ Items seeded one by one ] in
            ``rng/keys.py``; about 75 us per item). Needs a pipeline whose items have such
            a place: a map-style dataset or the library's sources, not your own iterable.
        worker_config: Rank, world size, command timeout, checkpoint policy.

    Raises:
        ConfigError: An argument cannot be honoured exactly.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int = 0,
        worker_config: WorkerConfig | None = None,
        seed_each_item: bool = False,
    ) -> None:
        check_arguments(num_workers, timeout, prefetch_factor, persistent_workers, in_order, seed)
        pipeline = build_pipeline(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
            collate_fn=collate_fn,
            generator=generator,
            seed=seed,
            draws_every_epoch=not (persistent_workers and num_workers > 0),
        )
        #: The pipeline the loader reads, as a stage (``datasets.as_stage(dataset)``).
        self.source, root, self._pipeline = pipeline.source, pipeline.root, pipeline
        #: NOTE [ Epoch orders ] in ``_main/sampling.py``; None when nothing is drawn there.
        self._planner = pipeline.planner
        #: Workers start anew for every epoch (NOTE [ Workers per epoch ]).
        self._restarts = num_workers > 0 and (not persistent_workers or pipeline.drawn_each_epoch)
        self.worker_config = worker_config or WorkerConfig()
        self.rank, self.world_size = self.worker_config.resolve()
        self.seed = seed
        prefetch = (prefetch_factor or 2) if num_workers > 0 else 0
        self._spec = RuntimeSpec(
            root=root,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            num_workers=num_workers,
            batch_size=root.batch_size,
            checkpoint_share=self.worker_config.checkpoint_share,
            max_lag=prefetch * num_workers + 2,
            torch_seeds=generator is not None,
            dataset=dataset,
            seed_each_item=seed_each_item,
        )
        self._wrapper = WorkerWrapper(self._spec)
        super().__init__(
            self._wrapper,  # type: ignore[arg-type]  # yields events; the loader, T_co
            batch_size=None,
            num_workers=num_workers,
            collate_fn=None,  # NOTE [ What the loader shows of its arguments ]
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=base_seed_generator(seed, self.rank),
            prefetch_factor=prefetch_factor,
            persistent_workers=num_workers > 0,
            pin_memory_device=pin_memory_device,
            **_torch_compat.in_order_argument(),
        )
        #: What torch's iterators read (NOTE [ What the loader shows of its arguments ]).
        self._for_torch = torch_arguments(self)
        self._own_generator = self._for_torch["generator"]
        shown = shown_arguments(
            pipeline,
            batch_sampler,
            batch_size,
            drop_last,
            in_order,
            generator,
            bool(persistent_workers),
        )
        for name, value in shown.items():
            object.__setattr__(self, name, value)
        if "__dataset" in self.__dict__:  # Lightning's record of the dataset: NOTE above
            object.__setattr__(self, "__dataset", dataset)
        #: What a state is checked against and resharded for (``_resume/compat.py``).
        self.layout = Layout(
            root, seed, self.rank, self.world_size, num_workers, seed_each_item=seed_each_item
        )
        self.fingerprint = self.layout.fingerprint
        self._book = Book.fresh(max(num_workers, 1))
        self._stream: Stream | None = None
        #: The book when the stream started: its checkpoints are ``_resume``.
        self._started = self._book.copy()
        #: Why the loader cannot continue until a restore (NOTE [ Errors stop the stream ]).
        self._broken: str | None = None
        self._closed = False
        self._last_worker: int | None = None
        self._retries = 2  # NOTE [ Workers that never started ] in _iterator.py
        #: The next iter() continues the stream instead of starting an epoch: the first
        #: one, and the first after a restore (NOTE [ A new iter() starts an epoch ]).
        self._continues = True
        self._length: LengthCheck | None = None  # set by len() (LengthCheck)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "collate_fn" and "layout" in self.__dict__:  # NOTE [ A collate_fn set later ]
            running = self._stream is not None
            layout = self._pipeline.use_collate(value, self.layout, running=running)
            self._halt()
            self.layout, self.fingerprint = layout, layout.fingerprint
        super().__setattr__(name, value)

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> LoaderIterator:  # type: ignore[override]
        """Returns an iterator over a new epoch, or over the rest of a restored one (NOTE
        [ A new iter() starts an epoch ])."""
        self._check_usable()
        if not self._continues and not self._book.all_ended():
            self._cut_epoch()
        elif new_epoch := self._book.all_ended():
            self._book.start_epoch()
            if self._stream is not None:
                try:
                    self._draw_epoch()
                    self._stream.next_epoch()
                except RuntimeError as error:
                    self._raise_if_workers_died(error, "while an epoch started")
                    raise
        if self._stream is None:
            self._start_stream(new_epoch=new_epoch)
        self._continues = False
        return LoaderIterator(self._next, self._length)

    def _start_stream(self, *, new_epoch: bool = False, idle: bool = False) -> None:
        """Starts the workers; ``idle`` ones only restore, replay and cut, without the
        epoch's draws (NOTE [ A cut before a sampler's next order ] in _stream_stops.py)."""
        self._spec.starts = self._book.starts(new_epoch=new_epoch, idle=idle)
        self._spec.epoch = self._book.epoch
        if not idle:
            self._draw_epoch()
        self._started = self._book.copy()
        self._stream = Stream(self, self._wrapper, self.worker_config)

    def _draw_epoch(self) -> None:
        """Makes the current epoch's draws in the main process, once (NOTE [ Epoch orders ])."""
        planner, generator = self._planner, self._own_generator
        if is_datapipe(pipe := self._pipeline.dataset):  # NOTE [ DataPipes ]
            seed_epoch(pipe, self.seed, self._book.epoch)
        if planner is not None:
            if planner.needs_draw(self._book.epoch):
                self._spec.fresh_seeds = planner.draw(self._book.epoch) is not None
            # Torch draws the same base seed from a copy of the generator before the draw.
            generator = planner.generator_before() or generator
        self._for_torch["generator"] = generator

    def _next(self) -> Any:
        while True:
            stream = self._stream
            if stream is None:
                self._check_usable()
                if self._book.all_ended():
                    raise StopIteration
                self._start_stream()
                continue
            if stream.done:
                raise StopIteration
            try:
                worker_id, seq, kind, payload = stream.next_event()
            except StopIteration:
                stream.done = True
                if not self._book.all_ended():
                    raise SavableLoaderError(
                        f"internal error: the epoch ended but workers {self._book.unended()} "
                        "did not report their end; please report"
                    ) from None
                if self._restarts:  # NOTE [ Workers per epoch ]: their ENDs start the next
                    self._book.resume = list(stream.checkpoints(self._book.delivered))
                    self._stop_stream()
                raise
            except Hang as hang:
                if not hang.restarts(lost := self._halt(hang), self._retries):
                    raise hang.stopped(lost) from None
                self._retries -= 1
                continue
            except Exception as error:
                # Whatever surfaces when a worker dies (torch's RuntimeError, a reset
                # connection while fetching a tensor it shared) becomes a WorkerError.
                self._raise_if_workers_died(error, "while producing items")
                self._halt()
                raise
            except BaseException:  # Ctrl-C: NOTE [ Interrupts ] in _runtime.py
                self._halt()
                raise
            if kind == PLACEHOLDER:
                continue
            if kind == ERROR and not payload.goes_on:
                self._raise_failure(payload)
            self._book.hand_on(worker_id, seq, kind)
            if kind == ERROR:  # NOTE [ Going on after an error ] in _runtime.py
                raise payload.raised(
                    in_worker=self.num_workers > 0, epoch=self._book.epoch, lost=None
                )
            if kind == END:
                continue
            self._last_worker, self._retries = worker_id if self.num_workers else None, 2
            return payload

    @property
    def last_worker(self) -> int | None:
        """The worker of the last item handed out (None before one, and without workers)."""
        return self._last_worker

    def __len__(self) -> int:
        """Batches this rank yields per epoch, as with torch (``Pipeline.batches``)."""
        contexts = [self._spec.context(w) for w in range(max(self.num_workers, 1))]
        batches = self._pipeline.batches(contexts, drop_last=self.drop_last)
        if self._pipeline.iterable:  # torch's warning, from the next iterator on
            items = self._pipeline.iterable_length()
            self._length = LengthCheck(items, self._pipeline.dataset, self.num_workers)
        return batches

    # -- save and restore -------------------------------------------------------------

    def save_state_rank(self) -> RankState:
        """Returns this rank's position in the stream; callable at any time.

        Items already prefetched are not part of the state: a restored loader recomputes
        them. Saving never waits for the item a worker is producing.

        Raises:
            WorkerError: A worker is dead or did not answer within its command timeout.
            UnsavableDatasetError: The dataset cannot save its position (an
                ``IterableDataset`` without ``save_state``/``state_dict``).
            SavableLoaderError: The loader lost its position after an error and needs a
                restore (NOTE [ Errors stop the stream ]).
        """
        self._check_usable()
        self.layout.check_savable()
        order = None if self._planner is None else self._planner.state
        return self._book.state(self._current_checkpoints(), self.layout, order)

    def _current_checkpoints(self) -> list[Checkpoint | None]:
        stream = self._stream
        try:
            if stream is not None and stream.started:
                return list(stream.checkpoints(self._book.delivered))
        except Hang as hang:  # NOTE [ Workers given up on ] in _stream.py; kept: restarts
            if not hang.restarts(lost := self._halt(hang), self._retries):
                raise hang.stopped(lost) from None
        except (RuntimeError, OSError, EOFError) as error:  # WorkerError included
            self._raise_if_workers_died(error, "during a save")
            raise
        return list(self._book.resume)

    def worker_stats(self) -> list[dict[str, Any]]:
        """Returns per-worker figures (checkpoints, their cost and size, ring entries,
        events replayed at start-up, and ``"storage"``: the worker's file cache figures,
        ``_runtime.storage_stats``); empty before the pipeline starts.

        Raises:
            WorkerError: A worker is dead or did not answer within its command timeout.
        """
        self._check_open()
        return [] if self._stream is None else self._stream.stats()

    def restore_state_rank(self, state: SavedStates | None, *, approximate: bool = False) -> None:
        """Moves the stream to ``state`` (None: the start); running workers are stopped.

        ``state`` is this rank's state, or the list of every rank's state of one save (as
        :meth:`save_state_global` or :func:`~savable_loader.load_state` return it), from
        which this rank takes its own. A list saved with another number of workers or
        ranks is resharded onto this loader's (NOTE [ Elastic resume ] in
        ``datasets/protocol/elastic.py``); a single state may change the number of workers only
        when it was saved on one rank. ``state`` is never modified. The next item comes
        from the restored position; a state saved after an epoch's end restores to
        between epochs.

        Args:
            state: The state, the list of every rank's state, or None.
            approximate: When the layout changes and the pipeline is not elastic, restart
                the interrupted epoch on the new layout (with an
                :class:`~savable_loader.ApproximateResumeWarning` saying so) instead of
                raising.

        Raises:
            StateError: ``state`` is malformed, or was saved by an incompatible loader
                (another pipeline, batch size or seed; another layout when the pipeline
                is not elastic and ``approximate`` is False).
        """
        self._check_open()
        book = Book.fresh(len(self._book.delivered))
        if state is not None:
            mine = own_state(state, self.layout, approximate=approximate)
            check_compatible(mine, self.layout)
            book = Book.of(mine)
        if self._planner is not None:
            order = None if state is None else mine.order
            self._planner.restore(order, epoch=book.epoch, between_epochs=book.all_ended())
        self._stop_stream()
        self._book = book
        self._broken = None
        self._continues = True

    def reshard(
        self,
        states: Sequence[RankState | dict[str, Any]],
        *,
        rank: int,
        approximate: bool = False,
    ) -> RankState:
        """Returns rank ``rank``'s state in this loader's layout from every rank's state of
        a save made with another number of workers or ranks (NOTE [ Elastic resume ] in
        ``datasets/protocol/elastic.py``). Nothing is restored; no process is started.

        Raises:
            StateError: As :meth:`restore_state_rank`.
        """
        return _elastic.reshard(one_save(states), self.layout, rank, approximate=approximate)

    def state_dict(self) -> dict[str, Any]:
        """Returns this rank's state for ``torch.distributed.checkpoint``, ``torch.save``, JSON.

        The result is ``{"rank_<r>": <encoded state>}``: one key per data-parallel rank,
        whose value is :meth:`save_state_rank` as a state file's bytes (a checked header,
        msgpack) in base64 text. See NOTE [ state_dict for checkpoints ] in ``_resume/compat.py``.
        """
        return {state_key(self.rank): encode_state(self.save_state_rank(), text=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returns (or returned as bytes), or a ``RankState``.

        Raises:
            StateError: The state is malformed, holds no entry for this rank, or was
                saved by an incompatible loader.
        """
        self.restore_state_rank(state_from_dict(state_dict, self.layout))

    # -- lifecycle --------------------------------------------------------------------

    def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()

    def close(self) -> None:
        """Stops the workers and releases their queues. Idempotent."""
        if self._closed:
            return
        self._stop_stream()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise SavableLoaderError("this SavableDataLoader is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._broken is not None:
            raise SavableLoaderError(f"this SavableDataLoader cannot continue: {self._broken}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
