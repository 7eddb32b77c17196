"""Retrying a file source's reads after transient storage errors.

NOTE [ Retries ]
A file source's cursor reads through :func:`retrying`: when a read, an open or a seek
fails, the cursor closes the file (its position is kept: NOTE [ JSON lines position ],
NOTE [ Tar position ]) and, if the error is transient, waits and reads again from that
position, so a retry neither loses nor repeats an item and a retried stream equals a
fault-free one.

What is transient is decided here and only here (:func:`is_transient`), by the nearest
known error along the chain ``__cause__`` (else ``__context__``) of what was raised, as
``storage_errors`` chains the backend's error under a ``StorageError``:

- transient: ``TimeoutError`` (``socket.timeout``), ``ConnectionError`` (reset, aborted,
  refused, broken pipe), ``http.client.IncompleteRead``, botocore's connection, timeout
  and streaming errors, a botocore ``ClientError`` whose code is a throttling code
  (``SlowDown``, ``Throttling``...) or whose HTTP status is 429 or 5xx, an aiohttp
  ``ClientError`` other than a response whose status is below 500 and not 429, requests'
  and urllib3's connection and timeout errors;
- permanent: ``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``, a
  ``ClientError`` for a missing object or bucket, denied access, 403 or 404, a malformed
  item (``ConfigError``), and every error not listed above: an unknown error is not
  retried.

A permanent error is raised at once (a ``StorageError`` naming the URL, or the
``ConfigError`` of a malformed item). A transient one is retried under
:data:`DEFAULT_POLICY`: 8 attempts in all, waits with full jitter (uniform in
``[0, cap]``) under caps of 0.25 s doubling up to 10 s (0.25, 0.5, 1, 2, 4, 8, 10 s), so
one read waits 25.75 s at most, 12.9 s on average, before it gives up: enough to ride out
an object store's throttling burst or a dropped connection, short enough that a store
that is down fails the job within half a minute. The attempts count per read: a read that
succeeds starts the next one afresh. Each retry is logged at WARNING by the
``savable_loader.storage.retry`` logger; after the last attempt the ``StorageError``
names the URL, the attempts and the last error. The jitter comes from a generator of this
module, never from the global ones, so retries leave the data stream and users'
augmentations untouched.

To change the policy of one source, pass ``retry=RetryPolicy(...)`` to it: the policy
travels with the source into every worker, whatever the start method. Sources without
one use :data:`DEFAULT_POLICY`; replacing that changes them all, in the process that
replaces it (forked workers inherit it; ``spawn`` and ``forkserver`` workers import this
module afresh). Counting a source's samples (NOTE [ Counting samples ] in
``datasets/files/sharded.py``) is retried the same way.
"""

from __future__ import annotations

import http.client
import importlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConfigError, SavableLoaderError, StorageError
from .urls import describe_error

__all__ = ["DEFAULT_POLICY", "RetryPolicy", "is_transient", "retrying"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How a retry waits; tests replace it (looked up at each wait).
sleep: Callable[[float], None] = time.sleep

_rng = random.Random()

_THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
    }
)
_PERMANENT_CODES = frozenset(
    {"NoSuchKey", "NoSuchBucket", "AccessDenied", "Forbidden", "NotFound", "InvalidAccessKeyId"}
)
# (module, class name) of optional libraries' transient errors, imported when classifying.
_TRANSIENT_CLASSES = (
    ("botocore.exceptions", "EndpointConnectionError"),
    ("botocore.exceptions", "ConnectTimeoutError"),
    ("botocore.exceptions", "ReadTimeoutError"),
    ("botocore.exceptions", "ConnectionClosedError"),
    ("botocore.exceptions", "ResponseStreamingError"),
    ("botocore.exceptions", "IncompleteReadError"),
    ("urllib3.exceptions", "ProtocolError"),
    ("urllib3.exceptions", "TimeoutError"),
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a read is retried after transient errors (NOTE [ Retries ]).

    Args:
        attempts: Tries in all, the first included (1: never retry).
        base_delay: Cap of the first wait, in seconds; each next cap doubles.
        max_delay: Largest cap, in seconds. A wait is drawn uniformly below its cap.

    Raises:
        ConfigError: ``attempts`` is below 1 or a delay is negative.
    """

    attempts: int = 8
    base_delay: float = 0.25
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ConfigError(f"RetryPolicy attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy attempts must be at least 1, got {self.attempts}")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ConfigError(
                f"RetryPolicy needs 0 <= base_delay <= max_delay, got base_delay="
                f"{self.base_delay} and max_delay={self.max_delay}"
            )

    def cap(self, retry: int) -> float:
        """The longest wait before retry ``retry`` (1 for the first)."""
        return min(self.max_delay, self.base_delay * 2.0 ** min(retry - 1, 64))

    def delay(self, retry: int) -> float:
        """A wait before retry ``retry``: uniform in ``[0, cap(retry)]`` (full jitter)."""
        return self.cap(retry) * _rng.random()

    @property
    def max_wait(self) -> float:
        """The longest a read waits in all before it gives up."""
        return sum(self.cap(retry) for retry in range(1, self.attempts))


#: The policy of every file source's reads (NOTE [ Retries ]); replace it to change it.
DEFAULT_POLICY = RetryPolicy()


def retrying(
    url: str,
    call: Callable[[], T],
    reset: Callable[[], None],
    policy: RetryPolicy | None = None,
) -> T:
    """Returns ``call()``, retried after transient errors under ``policy`` (None:
    :data:`DEFAULT_POLICY` as it is now).

    ``reset`` runs after every failure (it closes the file, keeping the position).

    Raises:
        StorageError: The error is permanent (raised as it came, or wrapped naming
            ``url``), or every attempt failed (names ``url``, the attempts, the last error).
        ConfigError: The item is malformed; never retried.
    """
    policy, waited = policy or DEFAULT_POLICY, 0.0
    for attempt in range(1, policy.attempts + 1):
        try:
            return call()
        except BaseException as exc:
            reset()
            if not isinstance(exc, Exception) or not is_transient(exc):
                if isinstance(exc, Exception) and not isinstance(exc, SavableLoaderError):
                    raise StorageError(f"Cannot read {url}: {describe_error(exc)}.") from exc
                raise
            if attempt == policy.attempts:
                raise StorageError(
                    f"Cannot read {url}: {policy.attempts} attempts failed with transient "
                    f"errors over {waited:.1f} s; the last: {describe_error(_root(exc))}."
                ) from exc
            delay = policy.delay(attempt)
            logger.warning(
                "Reading %s failed (%s); retry %d of %d in %.2f s",
                url,
                describe_error(_root(exc)),
                attempt,
                policy.attempts - 1,
                delay,
            )
            sleep(delay)
            waited += delay
    raise AssertionError("unreachable")  # pragma: no cover


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: the nearest known error of its chain decides
    (NOTE [ Retries ]); an unknown chain is permanent."""
    for error in _chain(exc):
        verdict = _verdict(error)
        if verdict is not None:
            return verdict
    return False


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then its cause (else its context), and so on; each error once."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _root(exc: BaseException) -> BaseException:
    """The innermost error of the chain, the one that says what happened."""
    return list(_chain(exc))[-1]


def _verdict(error: BaseException) -> bool | None:
    """True: transient; False: permanent; None: this link does not say."""
    if isinstance(error, ConfigError | FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    if isinstance(error, TimeoutError | ConnectionError | http.client.IncompleteRead):
        return True
    name = type(error).__name__
    if name == "ClientError" and type(error).__module__.startswith("botocore"):
        return _client_error(getattr(error, "response", None))
    if _is_aiohttp(error):
        status = getattr(error, "status", None)
        return not isinstance(status, int) or status == 429 or status >= 500
    return True if _is_listed(error) else None


def _client_error(response: Any) -> bool:
    """A botocore ``ClientError``: throttling codes, 429 and 5xx are transient."""
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in _PERMANENT_CODES or code in ("403", "404"):
        return False
    if code in _THROTTLING_CODES:
        return True
    if code.isdigit():
        status = int(code)
    return isinstance(status, int) and (status == 429 or status >= 500)


def _is_aiohttp(error: BaseException) -> bool:
    if not type(error).__module__.startswith("aiohttp"):
        return False
    base = _optional("aiohttp", "ClientError")
    return base is not None and isinstance(error, base)


def _is_listed(error: BaseException) -> bool:
    for module, name in _TRANSIENT_CLASSES:
        if not type(error).__module__.startswith(module.partition(".")[0]):
            continue
        cls = _optional(module, name)
        if cls is not None and isinstance(error, cls):
            return True
    return False


def _optional(module: str, name: str) -> type[BaseException] | None:
    """``module.name`` if the library is installed, else None."""
    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:  # an optional library that fails to import is absent
        return None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None
