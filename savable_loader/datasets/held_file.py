"""A file opened from the node's cache, holding the entry while it is open."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO, Any

__all__ = ["HeldFile"]


class HeldFile(io.BufferedIOBase):
    """A file opened from the cache: reads go to ``files[0]``; closing it closes
    ``files`` and runs ``release`` once (the entry's lock)."""

    def __init__(self, files: tuple[IO[bytes], ...], release: Callable[[], None]) -> None:
        super().__init__()
        self._files = files
        self._file = files[0]
        self._release: Callable[[], None] | None = release

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        return self._file.read(-1 if size is None else size)

    def readinto(self, buffer: Any) -> int:
        data = self._file.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:
        return self._file.readline(-1 if size is None else size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:  # the cached data file's, when read as stored (a token map)
        if len(self._files) > 1:
            raise io.UnsupportedOperation("a decompressed file from the cache has no fileno")
        return self._files[0].fileno()

    def close(self) -> None:
        if self.closed:
            return
        try:
            for file in self._files:
                file.close()
        finally:
            super().close()
            release, self._release = self._release, None
            if release is not None:
                release()
