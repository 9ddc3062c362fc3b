"""Writing results so that nothing half-written is ever left, and caching them.

- :func:`atomic_path`: a context giving a temporary name beside the target; on success it
  is renamed onto the target (``os.replace``, atomic on one file system), on error removed.
  Files and directories alike. :func:`write_text`, :func:`write_json` and
  :func:`write_table` are the common cases.
- :class:`Staging`: collect a command's result files in a temporary directory and move them
  into the output directory only when everything succeeded.
- :class:`JsonCache`: results keyed by the options and inputs that made them, so an
  interrupted analysis resumes and a repeated one is free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import fail


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
                raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
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
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _jsonable(value):
    """NumPy scalars as Python numbers; anything else (paths, dtypes) as its string."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else str(value)


def write_json(path: str | os.PathLike, data, *, indent: int | None = 2) -> Path:
    """JSON with a final newline (``indent=None``: one line, no newline); NumPy scalars as numbers."""
    text = json.dumps(data, indent=indent, default=_jsonable)
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
    into ``out`` (listed in ``written``), on an error they are discarded. ``out=None`` keeps nothing."""

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
        self.out.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted(self.tmp.iterdir()):
            partial = self.out / f".{f.name}.partial"
            shutil.move(f, partial)  # may cross file systems; the rename below is atomic
            os.replace(partial, self.out / f.name)
            written.append(self.out / f.name)
        return written


def digest(options: dict, *, arrays: dict | None = None, paths=()) -> str:
    """A 16-hex key of ``options`` (JSON), tensors or arrays in ``arrays`` (their bytes), and files
    in ``paths`` (size and modification time; directories recursively, ``analysis/`` skipped)."""
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
                h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class JsonCache:
    """JSON results in ``directory``, one file per name and key: computed once, then read back."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def get(self, name: str, key: str, compute):
        path = self.directory / f"{name}-{key}.json"
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json(path, value, indent=None)
        return value
