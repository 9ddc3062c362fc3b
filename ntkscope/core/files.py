"""Writing results so that nothing half-written is ever left, and caching them.

- :func:`atomic_path`: a context giving a temporary name beside the target; on success it
  is renamed onto the target (``os.replace``, atomic on one file system), on error removed.
  Files and directories alike. :func:`write_text`, :func:`write_json` and
  :func:`write_table` are the common cases.
- :class:`Staging`: collect a command's result files in a temporary directory and move them
  into the output directory only when everything succeeded.
- :class:`JsonCache`: results keyed by the options and inputs that made them, so an
  interrupted analysis resumes and a repeated one is free.
- :class:`DirectoryLock`: one writer per run directory; a second is refused with the PID
  of the first. The lock is ``fcntl.flock``'s, so a holder that died leaves nothing held.
- :func:`check_output`: an output path is checked before any work.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd
import safetensors
import safetensors.torch

from ntkscope.core.checks import OutputExists, UserError, fail

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, overwrite: bool = True):
    """Yield a temporary path beside ``path`` (same suffix); on success it replaces ``path``.

    A directory replaces an existing one only with ``overwrite`` (the old one is removed after
    the new one is in place). On an error the temporary file or directory is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    _remove(tmp)
    try:
        yield tmp
        if tmp.is_dir() and path.exists():
            if not overwrite:
                raise OutputExists(f"{path} exists; pass overwrite=True to replace it")
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)  # put the old one back
                raise
            _remove(old)
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary name, then a rename), making its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _jsonable(value):
    """NumPy scalars as Python numbers; anything else (paths, dtypes) as its string."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else str(value)


def _finite(value):
    """``value`` with every NaN or infinity (Python or NumPy) as None, NumPy scalars as Python ones."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def strict_json(data, *, indent: int | None = None) -> str:
    """RFC 8259 JSON text of ``data``: NaN and infinities as ``null`` (strict parsers reject
    ``NaN``), NumPy scalars as numbers, anything else unknown (paths, dtypes) as its string."""
    return json.dumps(_finite(data), indent=indent, default=_jsonable, allow_nan=False)


def write_json(path: str | os.PathLike, data, *, indent: int | None = 2) -> Path:
    """Strict JSON (:func:`strict_json`) with a final newline (``indent=None``: one line, no newline)."""
    text = strict_json(data, indent=indent)
    return write_text(path, text + "\n" if indent is not None else text)


def write_table(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """A table as ``.csv`` or ``.parquet`` (by the suffix), atomically."""
    path = Path(path)
    if path.suffix not in (".csv", ".parquet"):
        raise fail("save_table", "path", "must end in .csv or .parquet", str(path))
    with atomic_path(path) as tmp:
        if path.suffix == ".csv":
            frame.to_csv(tmp, index=False)
        else:
            frame.to_parquet(tmp, index=False)
    return path


class Staging:
    """Result files gathered in a temporary directory; a context manager: on success they move
    into ``out`` (listed in ``written``), on an error they are discarded. ``out=None`` keeps nothing.

    A result replaces the previous one in ``out`` whole: the files an earlier result wrote there
    (listed in ``out/.ntkscope-results.json``) and this one does not are removed, so a rerun with
    other options never leaves the old run's figure beside the new tables; other files are never
    touched. The move holds a lock on that manifest, so two processes never interleave."""

    MANIFEST = ".ntkscope-results.json"

    def __init__(self, out: str | os.PathLike | None):
        self.out = Path(out) if out is not None else None
        self.tmp = Path(tempfile.mkdtemp(prefix="ntkscope-"))
        self.written: list[str] = []

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.written = [str(p) for p in self._commit()]
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, name: str) -> Path:
        return self.tmp / name

    def _commit(self) -> list[Path]:
        if self.out is None:
            return []
        written = []
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / self.MANIFEST, "a+") as manifest:  # the manifest is the lock too
                fcntl.flock(manifest, fcntl.LOCK_EX)  # a second writer waits for the first to finish moving
                manifest.seek(0)
                try:
                    before = json.loads(manifest.read() or "{}").get("files", [])
                except json.JSONDecodeError:
                    before = []
                for f in sorted(self.tmp.iterdir()):
                    partial = self.out / f".{f.name}.partial"
                    shutil.move(f, partial)  # may cross file systems; the rename below is atomic
                    os.replace(partial, self.out / f.name)
                    written.append(self.out / f.name)
                names = [p.name for p in written]
                for stale in set(before) - set(names):  # the previous result's, not this one's
                    if "/" not in stale and not stale.startswith("."):
                        (self.out / stale).unlink(missing_ok=True)
                manifest.seek(0)
                manifest.truncate()
                manifest.write(json.dumps({"files": names}) + "\n")
                manifest.flush()
        except OSError as err:
            for f in self.out.glob(".*.partial") if self.out.is_dir() else ():
                f.unlink(missing_ok=True)
            done = f"written before the failure: {[p.name for p in written]}" if written else "nothing was written"
            raise UserError(f"could not write the results into {self.out} ({err.strerror or err}); {done}") from None
        return written


CONTENT_HASHED = 64 * 2**20  # files up to this size enter a key by their contents, larger ones by size and time


def copy_linked(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``src`` (a file or a directory tree) copied to ``dst``, each file hard-linked where the file
    system allows (nothing duplicated, the source untouched); nothing is done when ``dst`` exists."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        def link(a, b):
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)
        shutil.copytree(src, dst, copy_function=link)
    else:
        shutil.copy2(src, dst)


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (a manifest's ``files`` entries; weights
    compared byte for byte; ``provenance``)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(options: dict, *, arrays: dict | None = None, paths=()) -> str:
    """A 16-hex key of ``options`` (JSON), tensors or arrays in ``arrays`` (their bytes), and files
    in ``paths`` (directories recursively, ``analysis/`` skipped): by their contents up to
    :data:`CONTENT_HASHED` bytes (a tokenizer retrained in place changes the key), else by size
    and modification time."""
    h = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    for name in sorted(arrays or {}):
        value = arrays[name]
        value = value.cpu().numpy() if hasattr(value, "cpu") else value
        h.update(name.encode())
        h.update(value.tobytes())
    for p in paths:
        p = Path(p)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file() and "analysis" not in f.parts:
                st = f.stat()
                h.update(f"{f}:{st.st_size}".encode())
                if st.st_size <= CONTENT_HASHED:
                    h.update(hashlib.sha256(f.read_bytes()).digest())
                else:
                    h.update(f":{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def remove_stale_temporaries(directory: str | os.PathLike) -> int:
    """Remove the temporary files and directories (``.NAME.tmp-PID...``) that a process killed
    mid-write left in ``directory``; those of live processes stay. Returns how many went."""
    removed = 0
    for path in Path(directory).glob(".*.tmp-*") if Path(directory).is_dir() else ():
        pid = path.name.split(".tmp-", 1)[1].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(path)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JsonCache:
    """JSON results in ``directory``, one file per name and key: computed once, then read back.
    Temporaries left by a killed writer are cleared when the cache is opened."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        remove_stale_temporaries(self.directory)

    def get(self, name: str, key: str, compute):
        path = self.directory / f"{name}-{key}.json"
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json(path, value, indent=None)
        return value


def check_output(func: str, path, *, kind: str = "dir", suffixes=()) -> Path | None:
    """Check an output path before any work: a directory (``kind="dir"``) must not be an
    existing file, a file must not be an existing directory and must end in one of
    ``suffixes``; the nearest existing parent must be a writable directory."""
    if path is None:
        return None
    path = Path(path)
    if kind == "dir" and path.exists() and not path.is_dir():
        raise UserError(f"{func}: --out {path} exists and is not a directory")
    if kind == "file":
        if path.is_dir():
            raise UserError(f"{func}: --out {path} is a directory; name a file")
        if suffixes and path.suffix not in suffixes:
            raise UserError(f"{func}: --out {path} must end in {' or '.join(suffixes)}")
    parent = path if kind == "dir" else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{func}: --out {path} cannot be created: {parent} is not a writable directory")
    return path


class InUse(UserError):
    """A :class:`DirectoryLock` that another process holds (a caller may wait or move on)."""


class DirectoryLock:
    """``with DirectoryLock(run_dir, "cse-train"):`` holds ``run_dir/.ntkscope.lock`` for one writer.

    A second process is refused at once with one line naming the holder's PID; reading the
    directory stays allowed. ``fcntl.flock`` locks die with their process, so a lock left by
    a process that was killed is taken over (and said so in the log). On exit the lock file is
    removed, and so is the directory when this lock made it and nothing else was written there
    (a refused run leaves nothing behind)."""

    NAME = ".ntkscope.lock"

    def __init__(self, directory: str | os.PathLike, what: str, *, name: str | None = None,
                 subject: str | os.PathLike | None = None):
        self.directory, self.what = Path(directory), what
        self.name = name or self.NAME
        self.subject = subject if subject is not None else self.directory  # what the refusal says is in use
        self._fh = None
        self._made = False

    def _open_locked(self):
        """The lock file, opened and flocked; the file the path names when the lock was taken
        (one that a leaving holder unlinked in between is not a lock: open again)."""
        path = self.directory / self.name
        while True:
            try:
                fh = open(path, "a+")
            except OSError as err:  # a directory one cannot write in (/proc): one line, not a traceback
                raise UserError(f"{self.what}: cannot write in {self.directory} ({err.strerror or err}); use "
                                "another directory") from None
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                fh.close()
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise InUse(f"{self.what}: {self.subject} is in use by another process ({holder}); "
                                    "wait for it to finish or use another directory") from None
                raise
            try:
                if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                    return fh
            except FileNotFoundError:
                pass
            fh.close()

    def __enter__(self) -> "DirectoryLock":
        self._made = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        fh = self._open_locked()
        fh.seek(0)
        previous = fh.read().strip()
        remove_stale_temporaries(self.directory)
        if previous:
            _log.info("%s: taking over the lock on %s left by %s, which is no longer running", self.what,
                      self.directory, previous)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}: {self.what}\n")
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        fh, self._fh = self._fh, None
        try:
            os.unlink(self.directory / self.name)  # while still held: a waiting opener sees another file
        except FileNotFoundError:
            pass
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()
        if self._made:
            try:
                self.directory.rmdir()  # only when empty: this lock made it and nothing was written
            except OSError:
                pass


def output_lock(path: str | os.PathLike, what: str) -> DirectoryLock:
    """The one lock of a command's ``--out`` (a file or a directory ``F``), held from before its
    work to its last write: a lock file ``.F.lock`` beside it, so that the output itself is made
    only when there is a result (a killed or refused command leaves no empty directory) and two
    outputs in one folder never wait for each other. A second writer is refused at once in one
    line naming the holder."""
    path = Path(path)
    return DirectoryLock(path.parent, what, name=f".{path.name}.lock", subject=path)


def read_json_object(path: str | os.PathLike, func: str) -> dict:
    """A JSON file that must hold an object, or one line saying what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{func}: {path} is not valid JSON ({err})") from None
    except RecursionError:
        raise UserError(f"{func}: {path} is nested too deeply to be a result of ntkscope's (more than "
                        f"{sys.getrecursionlimit()} levels)") from None
    if not isinstance(data, dict):
        raise UserError(f"{func}: {path} must hold a JSON object (got {type(data).__name__})")
    return data


def check_safetensors(path: str | os.PathLike, func: str) -> dict:
    """Read only a safetensors file's header (cheap); one line naming the file when it is empty,
    truncated or not safetensors. Returns {name: (dtype, shape)}."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise UserError(f"{func}: {path} is empty")
    try:
        with safetensors.safe_open(str(path), framework="pt") as fh:
            return {k: (fh.get_slice(k).get_dtype(), tuple(fh.get_slice(k).get_shape())) for k in fh.keys()}
    except (safetensors.SafetensorError, OSError, RuntimeError) as err:
        raise UserError(f"{func}: {path} is not a readable safetensors file ({str(err).splitlines()[0][:160]})") from None


def load_safetensors(path: str | os.PathLike, func: str) -> dict:
    """A safetensors file as {name: tensor}, or one line naming the file when it is empty,
    truncated or not safetensors at all."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise UserError(f"{func}: {path} is empty")
    try:
        return safetensors.torch.load_file(str(path))
    except (safetensors.SafetensorError, OSError, RuntimeError) as err:
        raise UserError(f"{func}: {path} is not a readable safetensors file ({str(err).splitlines()[0][:160]})") from None
