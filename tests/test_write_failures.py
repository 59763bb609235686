"""Issue 37.3: a write that fails (full disk, file-size limit, I/O error, permissions) is one line naming the
folder and the cause, exit 2, with nothing partial left and an earlier checkpoint intact; the temporary folder
of a run killed while writing is removed by the next run on the same OUT, and nothing else is."""
from __future__ import annotations

import errno
import fcntl
import os
import resource
import shlex
import subprocess
import sys
import textwrap

import pytest
from safetensors import SafetensorError

from helpers import make_tiny_model, tree_hash

QUANTIZE = [sys.executable, "-c", "from quantkit.cli import main; main()", "quantize", "--method", "rtn",
            "--group-size", "32", "-q"]


@pytest.fixture
def src(tmp_path):
    return make_tiny_model(tmp_path / "models" / "tiny", "llama")


def _one_line(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]


def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def _earlier_checkpoint(src, out, cli):
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "-q")[0] == 0
    return tree_hash(out)


@pytest.mark.parametrize("overwrite", [False, True])
def test_file_size_limit_is_one_line(tmp_path, src, cli, overwrite):
    """`ulimit -f`: exit 1 with SafetensorError, before."""
    out = tmp_path / "out"
    before = _earlier_checkpoint(src, out, cli) if overwrite else None
    limit = 64 * 1024  # the weights file is ~700 KB; everything quantkit reads stays readable
    proc = subprocess.run(QUANTIZE + [str(src), "-o", str(out)] + ["--overwrite"] * overwrite, capture_output=True,
                          text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    _one_line(proc.returncode, proc.stderr, f"in '{tmp_path}' failed: File too large", "ulimit -f")
    assert _leftovers(tmp_path, "out") == []
    assert (tree_hash(out) == before) if overwrite else not out.exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_full_disk_is_one_line(tmp_path, src, overwrite):
    """A real full disk: a small tmpfs in a private mount namespace (exit 1 with SafetensorError, before). With
    --overwrite, a first checkpoint fits and a second beside it does not."""
    disk, size = tmp_path / "disk", "1100k" if overwrite else "300k"  # a checkpoint is ~730 KB
    disk.mkdir()
    first = f"{shlex.join(QUANTIZE)} {src} -o {disk}/out 2>/dev/null" if overwrite else "true"
    script = textwrap.dedent(f"""
        set -e
        mount -t tmpfs -o size={size} tmpfs {disk}
        {first}
        (cd {disk} && find . -type f | sort | xargs -r sha256sum) > {tmp_path}/before
        set +e
        {shlex.join(QUANTIZE)} {src} -o {disk}/out --overwrite 2>{tmp_path}/err
        echo $? > {tmp_path}/rc
        (cd {disk} && find . -type f | sort | xargs -r sha256sum) > {tmp_path}/after
        ls -A {disk} > {tmp_path}/left
    """)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _one_line(int((tmp_path / "rc").read_text()), (tmp_path / "err").read_text(),
              f"in '{disk}' failed: No space left on device", "free some space")
    assert (tmp_path / "left").read_text().split() == (["out"] if overwrite else [])  # no partial folder, no lock
    assert (tmp_path / "before").read_text() == (tmp_path / "after").read_text()  # the first checkpoint intact


@pytest.mark.parametrize("raised, words", [
    (SafetensorError("Error while serializing: I/O error: Input/output error (os error 5)"),
     ["Input/output error", "I/O error; check it"]),
    (PermissionError(errno.EACCES, "Permission denied"), ["Permission denied", "stopped being writable"]),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), ["Disk quota exceeded", "quota"]),
])
def test_write_errors_are_one_line_and_leave_nothing(tmp_path, src, cli, monkeypatch, raised, words):
    out = tmp_path / "out"
    before = _earlier_checkpoint(src, out, cli)
    import quantkit.formats.writer as writer

    def fail(folder, specs, tensors):
        (folder / "model.safetensors").write_bytes(b"half")
        raise raised
    monkeypatch.setattr(writer, "save_tensors", fail)
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "-q", "--overwrite")
    _one_line(code, err, f"writing the checkpoint in '{tmp_path}' failed", *words)
    assert _leftovers(tmp_path, "out") == [] and tree_hash(out) == before


def _debris(parent):
    """A killed run's partial folder, and things beside it that only look like one."""
    stale = parent / ".out.partial-ab12_xyz"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"x" * 1000)
    keep = [parent / ".out.partial-short", parent / ".other.partial-ab12_xyz", parent / "out.partial-ab12_xyz"]
    for k in keep:
        k.mkdir()
        (k / "mine.txt").write_text("mine")
    target = parent / "elsewhere"
    target.mkdir()
    (target / "mine.txt").write_text("mine")
    (parent / ".out.partial-link0000").symlink_to(target)
    (parent / ".out.partial-file0000").write_text("a file, not a folder")
    return stale, keep + [target, parent / ".out.partial-link0000", parent / ".out.partial-file0000"]


def test_killed_runs_partial_folder_is_removed_by_the_next_run(tmp_path, src, cli):
    stale, keep = _debris(tmp_path)
    hashes = {k: tree_hash(k) if k.is_dir() else k.read_text() for k in keep}
    assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--group-size", "32", "-q")[0] == 0
    assert not stale.exists()
    assert all((tree_hash(k) if k.is_dir() else k.read_text()) == h for k, h in hashes.items())
    assert (tmp_path / ".out.partial-link0000").is_symlink()


def test_partial_folder_is_kept_while_another_run_holds_the_lock(tmp_path, src, cli):
    stale, _ = _debris(tmp_path)
    fd = os.open(tmp_path / ".out.quantkit-lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242")
        code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--group-size", "32", "-q")
    finally:
        os.close(fd)
    _one_line(code, err, "another quantkit run (pid 4242)")
    assert (stale / "sub" / "model.safetensors").is_file()
