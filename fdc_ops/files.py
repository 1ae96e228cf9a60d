"""Writing files so that nothing is lost: every file the package writes (artifacts, converted models, eval points and
results, benchmark JSON) goes to a temporary name beside its destination, is flushed to disk, and is renamed into
place, so a crash at any byte leaves the old file or the new one, never a broken one. Files are created readable by
the group and others as the umask allows (not 0600, as temporary files are), so a shared cache works."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Calls ``write(temporary)``, which writes the new content to the temporary path, then renames it over
    ``path`` (created with its parent directories). If ``write`` raises, ``path`` is untouched and the temporary file
    is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        with open(temporary, "rb+") as file:  # on disk before the rename makes it visible
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    return write_atomically(path, lambda temporary: temporary.write_text(text))


def write_json_atomically(path: str | os.PathLike, value, **dumps) -> Path:
    """``value`` as JSON (``dumps``: json.dumps options), newline-terminated."""
    return write_text_atomically(path, json.dumps(value, **dumps) + "\n")
