"""Typed, closed, versioned models of a saved loader state.

Every model is frozen and refuses extra fields; scalar fields are strict, so a hand-edited
state with a wrong type fails at the door with pydantic's field path instead of deep
inside a worker. Serialisation (msgpack, file header) lives in
:mod:`savable_loader.serialization`; these models only convert to and from plain data.

NOTE [ State format versions ]
Format 2 keeps a checkpoint's pipeline state as plain data inside the state (checked like
the rest of the file, ``plain.py``), where format 1 kept the dataset's state as msgpack
bytes and the end of a batching epoch as a separate ``exhausted`` flag; batching is now a
stage of the pipeline (NOTE [ Batching is a stage ] in ``datasets/transforms/batch.py``), so that
flag is part of its state. A format-1 state is migrated on load (``migrate.py``) and
restores exactly as before; it is never refused for its version.

NOTE [ Sequence numbers ]
Each worker numbers the *events* it produces: one per batch (an "item" of the loader)
and one per end of epoch, whether the worker reached it or the loader cut the epoch
short (NOTE [ A new iter() starts an epoch ] in ``_main/iterator.py``). ``delivered`` counts
the events the loader handed on (end markers included), so ``delivered`` is the sequence
number of the next event the consumer wants from that worker. A checkpoint at ``seq`` is
the worker's state just before producing event ``seq``; restoring it and replaying
``delivered - seq`` events reaches the consumer's position exactly. A checkpoint is
always taken right after an end-of-epoch event, so a replay never crosses an epoch
boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictBytes,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_serializer,
    model_validator,
)

from ..errors import StateFormatError
from ..plain import find_non_plain
from .generators import check_python, check_torch
from .migrate import migrate

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "OrderSnapshot",
    "OrderState",
    "RankState",
    "RngState",
    "WorkerState",
]

#: Version of the state layout below. Bumped on any incompatible change to the models;
#: older versions are migrated on load (NOTE [ State format versions ]).
FORMAT_VERSION = 2

_MAX_WORKERS = 4096

NonNegative = Annotated[StrictInt, Field(ge=0)]


def _plain(what: str) -> Callable[[Any], Any]:
    """A validator that refuses a value which is not plain data (``plain.py``)."""

    def check(value: Any) -> Any:
        problem = find_non_plain(value)
        if problem is not None:
            raise ValueError(f"{what} is not plain data: {problem}")
        return value

    return check


def _generators_inside(state: Any) -> Any:
    """Checks every generator state a pipeline state holds (a stage's saved generators,
    such as a ``Shuffle`` window's) as :class:`RngState` checks the worker's: NOTE
    [ Generator states are checked at the door ] in ``generators.py``. A generator state
    is recognised by its fields, wherever a stage keeps it."""
    pending: list[tuple[str, Any]] = [("state", state)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            if value.keys() == RngState.model_fields.keys():
                try:
                    RngState.model_validate(value)
                except ValidationError as error:
                    problems = "; ".join(str(e["msg"]) for e in error.errors())
                    raise ValueError(
                        f"the generator state at {path} is invalid: {problems}"
                    ) from None
            pending.extend((f"{path}.{key}", item) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return state


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RngState(_Model):
    """The three global generators of one worker, as plain bytes and numbers.

    Attributes:
        python: Python ``random``'s 624 Mersenne Twister words and position, uint32 LE.
        python_gauss: ``random``'s cached Gaussian (``gauss_next``), or None.
        numpy_key: ``numpy.random``'s 624 Mersenne Twister words, uint32 LE.
        numpy_pos: Position in ``numpy_key``.
        numpy_has_gauss: Whether NumPy holds a cached Gaussian (0 or 1).
        numpy_gauss: NumPy's cached Gaussian.
        torch: torch's CPU generator state as returned by ``torch.get_rng_state()``.

    Each generator's part is checked as its own setter checks it (``random.setstate``,
    ``torch.Generator.set_state``) when the model is built: a crafted state fails here,
    never in the generator (NOTE [ Generator states are checked at the door ] in
    ``generators.py``).
    """

    python: Annotated[StrictBytes, Field(min_length=2500, max_length=2500)]
    python_gauss: StrictFloat | None
    numpy_key: Annotated[StrictBytes, Field(min_length=2496, max_length=2496)]
    numpy_pos: Annotated[StrictInt, Field(ge=0, le=624)]
    numpy_has_gauss: Annotated[StrictInt, Field(ge=0, le=1)]
    numpy_gauss: StrictFloat
    torch: Annotated[StrictBytes, Field(min_length=1, max_length=1 << 20)]

    @model_validator(mode="after")
    def _generators_accept_it(self) -> RngState:
        # NOTE [ Generator states are checked at the door ] in generators.py
        check_python(self.python, self.python_gauss)
        check_torch(self.torch)
        return self


class Checkpoint(_Model):
    """A worker's state just before it produces event ``seq``.

    Attributes:
        seq: Sequence number of the next event (see NOTE [ Sequence numbers ]).
        state: The state of the worker's pipeline, batching included (its cursor tree's
            ``state()``, NOTE [ The cursor contract ] in ``datasets/protocol/cursor.py``), as plain
            data.
        rng: The worker's global generators; None when ``seeded_epoch`` says what they are.
        seeded_epoch: The generators are exactly as the loader seeds them for this epoch
            (NOTE [ Generators per epoch ] in ``_worker/runtime.py``): nothing had drawn from
            them since, and a restore seeds them again instead of reading bytes (NOTE
            [ Untouched generators ] in ``rng/generators.py``). None when ``rng`` holds the bytes;
            left out of the plain data then, so such a state reads as it always did.

    Exactly one of ``rng`` and ``seeded_epoch`` is set.
    """

    seq: NonNegative
    state: Annotated[
        Any, AfterValidator(_plain("the pipeline state")), AfterValidator(_generators_inside)
    ]
    rng: RngState | None
    seeded_epoch: NonNegative | None = None

    @model_validator(mode="after")
    def _generators_once(self) -> Checkpoint:
        if self.rng is None and self.seeded_epoch is None:
            raise ValueError(
                "rng is None and seeded_epoch is not given: the checkpoint does not say "
                "what the worker's generators are"
            )
        if self.rng is not None and self.seeded_epoch is not None:
            raise ValueError(
                f"rng holds generator bytes and seeded_epoch is {self.seeded_epoch}: "
                "a checkpoint holds one of them"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_unset_epoch(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.seeded_epoch is None:
            data.pop("seeded_epoch", None)
        return data


class OrderSnapshot(_Model):
    """The generators the main process draws an epoch's order from, at one moment
    (NOTE [ Epoch orders ] in ``_main/sampling.py``).

    Attributes:
        rng: The main process's global generators.
        generators: The states of the loader's ``generator`` and of the sampler's own
            generators, in the order the loader finds them.
        sampler: The sampler's ``state_dict()`` when it has one, else None.
        sampler_epoch: The sampler's ``epoch`` attribute (``DistributedSampler``), or None.
    """

    rng: RngState
    generators: tuple[Annotated[StrictBytes, Field(max_length=1 << 20)], ...]
    sampler: Annotated[Any, AfterValidator(_plain("the sampler's state"))] = None
    sampler_epoch: StrictInt | None = None

    @model_validator(mode="after")
    def _generators_accept_them(self) -> OrderSnapshot:
        for index, data in enumerate(self.generators):
            try:
                check_torch(data)
            except ValueError as error:
                raise ValueError(f"generators[{index}]: {error}") from None
        return self


class OrderState(_Model):
    """How the main process drew the order of the current epoch.

    Attributes:
        epoch: The epoch whose order was drawn.
        before: The generators just before the draw.
        after: The generators just after it (where the next epoch's draw starts).
    """

    epoch: NonNegative
    before: OrderSnapshot
    after: OrderSnapshot


class WorkerState(_Model):
    """Where the consumer stands in one worker's stream.

    Attributes:
        worker_id: The worker's id (``get_worker_info().id``); 0 without workers.
        delivered: Events of this worker handed on by the loader, end markers included.
        ended: Whether this worker's end of the current epoch was handed on.
        checkpoint: The newest checkpoint at or before ``delivered``; None for a worker
            that never started (it starts from the dataset's initial state).
    """

    worker_id: NonNegative
    delivered: NonNegative
    ended: StrictBool
    checkpoint: Checkpoint | None

    @model_validator(mode="after")
    def _checkpoint_not_ahead(self) -> WorkerState:
        if self.checkpoint is not None and self.checkpoint.seq > self.delivered:
            raise ValueError(
                f"checkpoint.seq ({self.checkpoint.seq}) is past delivered ({self.delivered})"
            )
        return self

    @property
    def replay(self) -> int:
        """Events to recompute after restoring ``checkpoint`` (all of them when None)."""
        return self.delivered - (self.checkpoint.seq if self.checkpoint is not None else 0)


class RankState(_Model):
    """The state of one rank's loader: what ``save_state_rank()`` returns.

    Attributes:
        format_version: Layout version of this model (:data:`FORMAT_VERSION`).
        library_version: savable_loader version that wrote the state (informational).
        fingerprint: Hash of the pipeline's ``config()`` and the loader arguments that
            shape the stream; a restore refuses a state saved under another one.
        rank: This loader's rank.
        world_size: Number of ranks.
        num_workers: Worker processes (0: the main process ran the pipeline).
        batch_size: Items per batch, None when the loader does not batch.
        seed: The loader seed all random choices derive from.
        epoch: Index of the current epoch (the one in progress or the last one ended).
        next_worker: Worker whose event comes next in torch's round-robin order.
        workers: One entry per worker (one entry when ``num_workers`` is 0).
        order: How the epoch's order was drawn, when the main process draws it (a
            ``sampler``, ``batch_sampler`` or ``generator``); None otherwise.
        callables: The names of the functions and classes the pipeline's config names
            (a ``Map`` function, the ``collate_fn``, the dataset's class), by where they
            stand in it, so that a refused fingerprint names the one that differs
            (NOTE [ Names from a script ] in ``names.py``); None in states of earlier
            versions.
    """

    format_version: StrictInt
    library_version: StrictStr
    fingerprint: StrictStr
    rank: NonNegative
    world_size: Annotated[StrictInt, Field(ge=1)]
    num_workers: Annotated[StrictInt, Field(ge=0, le=_MAX_WORKERS)]
    batch_size: Annotated[StrictInt, Field(ge=1)] | None
    seed: StrictInt
    epoch: NonNegative
    next_worker: NonNegative
    workers: tuple[WorkerState, ...]
    order: OrderState | None = None
    callables: dict[StrictStr, StrictStr] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RankState:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"format_version {self.format_version} is not {FORMAT_VERSION}, "
                "the version this savable_loader reads"
            )
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        expected = max(self.num_workers, 1)
        if len(self.workers) != expected:
            raise ValueError(
                f"{len(self.workers)} worker entries for num_workers={self.num_workers}, "
                f"expected {expected}"
            )
        for index, worker in enumerate(self.workers):
            if worker.worker_id != index:
                raise ValueError(f"workers[{index}] has worker_id {worker.worker_id}")
        if self.next_worker >= expected:
            raise ValueError(f"next_worker {self.next_worker} is not a worker id")
        return self

    @property
    def between_epochs(self) -> bool:
        """True when every worker ended the epoch: the next ``iter()`` starts a new one."""
        return all(worker.ended for worker in self.workers)

    def to_plain(self) -> dict[str, Any]:
        """Returns the state as plain data (dict, list, str, int, float, bool, None, bytes)."""
        return _listify(self.model_dump(mode="python"))  # type: ignore[no-any-return]

    @classmethod
    def from_plain(cls, data: Any) -> RankState:
        """Validates plain data (as :meth:`to_plain` returns) into a state.

        Raises:
            StateFormatError: ``data`` is not a state of this format version, or a field
                is missing, extra, of the wrong type or out of range.
        """
        if isinstance(data, RankState):
            return data
        if not isinstance(data, dict):
            raise StateFormatError(
                f"a loader state is a dict, got {type(data).__name__}; pass what "
                "save_state_rank(), state_dict() or load_state() returned"
            )
        version = data.get("format_version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise StateFormatError(
                f"state format_version {version} is newer than {FORMAT_VERSION}, the newest "
                "this savable_loader reads; upgrade savable_loader to restore it"
            )
        try:
            return cls.model_validate(migrate(data))
        except ValidationError as error:
            raise StateFormatError(f"invalid loader state: {error}") from None


def one_save(states: Sequence[Any]) -> list[RankState]:
    """Validates the states of one save: one per rank, in rank order, as
    ``save_state_global()`` returns them (``RankState`` or plain data).

    Raises:
        StateFormatError: The list is empty, an entry is malformed, or an entry is not
            the state of the rank at its index of a save of ``len(states)`` ranks.
    """
    validated = [RankState.from_plain(state) for state in states]
    if not validated:
        raise StateFormatError("an empty list of states: a save has one state per rank")
    for index, state in enumerate(validated):
        if state.rank != index or state.world_size != len(validated):
            raise StateFormatError(
                f"states[{index}] is the state of rank {state.rank} of {state.world_size}; "
                "the list must hold one state per rank in rank order, as save_state_global() "
                "returns it"
            )
    return validated


def _listify(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _listify(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_listify(item) for item in value]
    return value
