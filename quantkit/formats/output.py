"""The output folder of a run: claimed before any work, locked for the run, replaced only if quantkit owns it.

A folder is quantkit's when it holds the `quantkit.json` the writer puts in every checkpoint. `--overwrite`
replaces such a folder and nothing else, so a mistyped `-o .` or `-o SRC` can never delete a user's files. The
lock is a file beside OUT (OUT itself may not exist yet) held with flock for the whole run, so two runs aimed at
one OUT cannot both think they own it; the final rename checks again that OUT is still what was claimed. The
temporary folders of runs killed before their rename are removed by the next run that takes the lock.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError

MARKER = "quantkit.json"


def is_checkpoint(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def _check_not_source(out: Path, source: Path | None) -> None:
    if source is None:
        return
    src = source.resolve()
    if _inside(out, src):
        what = "is" if out == src else "is inside"
        raise UserError(f"output '{out}' {what} the source model '{src}'; choose an -o path outside it")
    if _inside(src, out):
        raise UserError(f"output '{out}' contains the source model '{src}'; choose an -o path that does not")


def _check_existing(out: Path, overwrite: bool) -> str:
    """What OUT is now: 'absent', 'empty' or 'checkpoint'; anything else is refused."""
    if not out.exists():
        if not out.parent.is_dir():
            raise UserError(f"the parent folder of '{out}' does not exist; create it first")
        return "absent"
    if not out.is_dir():
        raise UserError(f"output '{out}' exists and is a file; choose another -o path")
    if os.path.ismount(out):  # a mount point cannot be renamed away or onto
        raise UserError(f"output '{out}' is a mount point; checkpoints are written beside OUT and renamed into "
                        "place, so choose a folder inside it")
    if not any(out.iterdir()):
        return "empty"
    if not is_checkpoint(out):
        raise UserError(f"output folder '{out}' is not empty and is not a quantkit checkpoint (no {MARKER}); "
                        "quantkit replaces only folders it wrote: choose another -o path")
    if not overwrite:
        raise UserError(f"output folder '{out}' is not empty; pass --overwrite to replace this checkpoint or "
                        "choose another -o path")
    return "checkpoint"


def _check_writable(parent: Path) -> None:
    """Probe by writing, since permission bits do not tell about read-only mounts, and root ignores them."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".quantkit-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write in '{parent}' ({e.strerror}); choose a writable -o path") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _folder_mode(out: Path) -> int:
    if out.is_dir():
        return out.stat().st_mode & 0o7777
    return 0o777 & ~_umask()


def _open_files(tmp: Path) -> None:
    """Give every file the mode the user's umask gives a new file: safetensors writes its files 0600, which
    left a checkpoint that the serving account, a shared cache or a container user could not read."""
    mode = 0o666 & ~_umask()
    for f in tmp.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, mode)


class OutputClaim:
    """Holds OUT for one run: check, lock, temporary folder, and the final rename."""

    def __init__(self, out: Path, source: Path | None = None, overwrite: bool = False):
        self.out = Path(out).expanduser().resolve()
        self.overwrite = overwrite
        _check_not_source(self.out, source)
        self.state = _check_existing(self.out, overwrite)
        _check_writable(self.out.parent)
        self.lock_path = self.out.parent / f".{self.out.name}.quantkit-lock"
        self._fd: int | None = None
        self._inode = self.out.stat().st_ino if self.state != "absent" else None

    # -- lock ------------------------------------------------------------------------------------------
    def __enter__(self) -> "OutputClaim":
        import fcntl

        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UserError(f"another quantkit run (pid {holder}) is writing '{self.out}'; wait for it to "
                                "finish or choose another -o path") from None
            # the previous holder may have unlinked the file between our open and our lock: lock the live file
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        try:
            self._recover_replaced()
        except BaseException:
            self.__exit__()
            raise
        self._remove_stale_partials()
        return self

    def _recover_replaced(self) -> None:
        """A run killed inside commit's fallback swap leaves the previous OUT at `.OUT.old-PID`: put it back when
        OUT is missing (the new one never arrived), drop it when OUT is there (the swap had finished). We hold the
        lock, so its writer is dead; only folders with exactly that name are touched."""
        pattern = re.compile(rf"\.{re.escape(self.out.name)}\.old-[0-9]+")
        for entry in sorted(os.scandir(self.out.parent), key=lambda e: e.name):
            if not (pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            if os.path.lexists(self.out):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.rename(entry.path, self.out)
                self.state = _check_existing(self.out, self.overwrite)
                self._inode = self.out.stat().st_ino

    def _remove_stale_partials(self) -> None:
        """Remove `.OUT.partial-XXXXXXXX` folders a killed run left: only a run holding OUT's lock writes one, and
        we hold it now, so any that exists is dead. Only folders with exactly temporary()'s name are touched."""
        pattern = re.compile(rf"\.{re.escape(self.out.name)}\.partial-[A-Za-z0-9_]{{8}}")
        for entry in os.scandir(self.out.parent):
            if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.lock_path)
            except FileNotFoundError:
                pass
            os.close(self._fd)  # closing releases the flock
            self._fd = None

    # -- writing -----------------------------------------------------------------------------------------
    def temporary(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))

    def _still_as_claimed(self) -> None:
        now = "absent" if not self.out.exists() else None
        if now is None and self.out.is_dir():
            if self.out.stat().st_ino != self._inode:
                now = "replaced"
            elif self.state == "empty" and not any(self.out.iterdir()):
                now = "empty"
            elif self.state == "checkpoint" and is_checkpoint(self.out):
                now = "checkpoint"
        if now != self.state:
            raise UserError(f"'{self.out}' changed while quantising (something else wrote there); nothing was "
                            "replaced, choose another -o path")

    def commit(self, tmp: Path) -> Path:
        """Rename TMP to OUT, replacing OUT only if it is still the empty folder or checkpoint claimed."""
        self._still_as_claimed()
        # mkdtemp made TMP 0700: give it OUT's own mode, or what the user's umask gives a new folder; only now,
        # as a read-only mode copied from OUT would have stopped the writing
        _open_files(tmp)
        os.chmod(tmp, _folder_mode(self.out))
        old = None
        if self.state != "absent":
            if _exchange(tmp, self.out):  # one atomic step: OUT is never missing, TMP now holds the old one
                shutil.rmtree(tmp, ignore_errors=True)
                return self.out
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, old)
        try:
            _rename_noreplace(tmp, self.out)
        except BaseException:
            if old is not None:
                os.rename(old, self.out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _appeared(dst: Path) -> UserError:
    return UserError(f"'{dst}' appeared while quantising; nothing was replaced, choose another -o path")


def _renameat2(src: Path, dst: Path, flag: int) -> int | None:
    """0 on success, else errno; None where libc has no renameat2."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    at_fdcwd = -100
    return 0 if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flag) == 0 else ctypes.get_errno()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the file system cannot (the caller then renames in two steps)."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err in (None, errno.EINVAL, errno.ENOSYS):
        return False
    if err:
        raise OSError(err, os.strerror(err), str(b))
    return True


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails if DST exists (an empty folder included, which plain rename would replace)."""
    err = _renameat2(src, dst, _RENAME_NOREPLACE)
    if err == 0:
        return
    if err == errno.EEXIST:
        raise _appeared(dst)
    if err not in (None, errno.EINVAL, errno.ENOSYS):  # EINVAL/ENOSYS: the file system lacks the flag
        raise OSError(err, os.strerror(err), str(dst))
    if dst.exists():
        raise _appeared(dst)
    os.rename(src, dst)
