"""A failed checkpoint write as one line: which folder, what the system said, and what to do.

safetensors reports a failed write as its own SafetensorError whose text ends in "(os error N)", not as an
OSError, so the errno is read from the text; both reach the user as the same UserError, by cause.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ..errors import UserError

_HINTS = {
    errno.ENOSPC: "free some space, or choose an -o path on a disk with room for the checkpoint",
    errno.EDQUOT: "free some of your disk quota, or choose an -o path elsewhere",
    errno.EFBIG: "a file-size limit (ulimit -f) or the file system's largest file is smaller than a weights file; "
                 "raise the limit or choose an -o path on another file system",
    errno.EIO: "the disk reported an I/O error; check it, or choose an -o path on another disk",
    errno.EACCES: "the folder stopped being writable during the run; make it writable or choose another -o path",
    errno.EPERM: "the folder stopped being writable during the run; make it writable or choose another -o path",
    errno.EROFS: "the file system is read-only; choose a writable -o path",
}
_OS_ERROR = re.compile(r"os error (\d+)")


def failed_errno(exc: BaseException) -> int | None:
    """The errno behind a failed write: an OSError's own, or the one safetensors names in its message."""
    if isinstance(exc, OSError):
        return exc.errno
    if type(exc).__name__ == "SafetensorError":
        m = _OS_ERROR.search(str(exc))
        return int(m.group(1)) if m else None
    return None


def write_failure(exc: BaseException, folder: Path, out: Path) -> UserError | None:
    """The UserError for EXC, a failure while writing OUT's files in FOLDER; None when EXC is no write failure."""
    code = failed_errno(exc)
    if code is None:
        return None
    hint = _HINTS.get(code, "choose another -o path")
    return UserError(f"writing the checkpoint in '{folder}' failed: {os.strerror(code)}; nothing was written to "
                     f"'{out}' (a checkpoint already there is unchanged): {hint}")
