"""Files that are whole or absent: atomic writes and checked reads of caches and run files.

A cache written in place (`open(path, "w")` then `json.dump`) is left half-written when the
process dies mid-write, and the next run takes the torn file for a finished one. The writers here
write a temporary file in the same directory, flush it to disk and `os.replace` it onto `path`
(atomic on POSIX and Windows within one file system), so a reader sees the old file, the new one,
or none. Concurrent writers of one path each use their own temporary file; the last replace wins.

`read_json` raises `CorruptFileError` (a `ValueError`) naming the file when it is not valid JSON,
so a cache reader can rebuild the file or stop with a clear message instead of a bare
JSONDecodeError from deep inside a loader.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
from typing import Any

log = logging.getLogger(__name__)


class CorruptFileError(ValueError):
  """A file that exists but cannot be read back (torn, truncated or garbled)."""

  def __init__(self, path: str, why: str):
    self.path = path
    super().__init__(f"{path} is corrupt ({why}); delete it to rebuild it")


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path` atomically (temp file in the same directory, fsync, `os.replace`).
  The file gets the permissions `open(path, "w")` would give it (0o666 less the umask)."""
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                f"{secrets.token_hex(4)}.tmp")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
  _fsync_directory(directory)


def atomic_write_text(path: str, text: str, encoding: str = "utf-8") -> None:
  """`atomic_write_bytes` of `text` encoded with `encoding`."""
  atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str, obj: Any, **dump_kw) -> None:
  """Serializes `obj` with `json.dumps(obj, **dump_kw)` first (a value that fails to serialize
  leaves no file behind), then writes it atomically."""
  atomic_write_text(path, json.dumps(obj, **dump_kw))


def read_json(path: str) -> Any:
  """The JSON value in `path`; CorruptFileError when the file is not valid UTF-8 JSON (a torn
  write), FileNotFoundError when it does not exist."""
  with open(path, "rb") as f:
    raw = f.read()
  try:
    return json.loads(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise CorruptFileError(path, f"not UTF-8 at byte {e.start}") from None
  except json.JSONDecodeError as e:
    raise CorruptFileError(path, f"invalid JSON at line {e.lineno} column {e.colno}: "
                                 f"{e.msg}") from None


def _fsync_directory(directory: str) -> None:
  """Makes the rename itself durable where the platform allows it (best effort)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


__all__ = ["CorruptFileError", "atomic_write_bytes", "atomic_write_json", "atomic_write_text",
           "read_json"]


@contextlib.contextmanager
def build_lock(path: str):
  """An exclusive lock on the file `path` (made if absent) for the `with` block: processes on
  one machine that would build the same cached thing take turns, and the ones that wait find it
  built. Blocks until the lock is free."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "a") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      log.info("waiting for another process holding %s", path)
      fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
