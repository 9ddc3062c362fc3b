"""What made a result: the code's version and commit, the libraries and machine, the command
line, and the sha256 of the weights and of the data read, for every ``result.json``."""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
from pathlib import Path

import torch

from ntkscope.core.files import sha256_file

#: weight files a checkpoint directory may hold (cse_models, HF single or sharded, plain state dicts; not the
#: optimizer state beside them)
WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin", "model*.pt")

_command: str | None = None


def set_command(argv) -> None:
    """Record the command line a result comes from (the ``ntkscope`` command sets it)."""
    global _command
    _command = shlex.join(str(a) for a in argv)


def environment() -> dict:
    """ntkscope's version and commit, torch, Python and the machine."""
    import ntkscope  # the package root: it imports the stages (and so this module) itself

    try:  # the code's commit, when ntkscope runs from a git checkout
        commit = subprocess.run(["git", "-C", str(Path(ntkscope.__file__).parent), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"ntkscope": ntkscope.__version__, "commit": commit, "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, threads "
                       f"{torch.get_num_threads()}" + (f", {torch.cuda.get_device_name(0)}"
                                                       if torch.cuda.is_available() else ", no GPU")}


def files_sha256(paths) -> str | None:
    """The sha256 of the data or weights in ``paths`` (directories: their files, recursively, in
    sorted order, ``analysis/`` caches left out): one file's is the sha256 of its bytes (what
    ``sha256sum`` prints); several files' is the sha256 of their "relative name  sha256" lines;
    None for none."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += [(str(f.relative_to(p)), f) for f in sorted(p.rglob("*"))
                      if f.is_file() and "analysis" not in f.relative_to(p).parts]
        elif p.is_file():
            files.append((p.name, p))
    if not files:
        return None
    sums = [(name, sha256_file(f)) for name, f in files]
    if len(sums) == 1:
        return sums[0][1]
    return hashlib.sha256("".join(f"{name}  {digest}\n" for name, digest in sums).encode()).hexdigest()


def weights_sha256(checkpoint) -> str | None:
    """The sha256 of a checkpoint's weight files (a directory's :data:`WEIGHT_FILES`, or the file
    itself): one file's is ``sha256sum``'s; None when there are none."""
    path = Path(checkpoint)
    if path.is_file():
        return files_sha256([path])
    if not path.is_dir():
        return None
    return files_sha256(sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern)}))


def provenance(*, weights=None, data_files=(), **more) -> dict:
    """``result.json``'s ``provenance``: :func:`environment`, the command line (or None for a
    library call), ``weights`` ({name: sha256} of checkpoints, or one checkpoint's), and the data's sha256."""
    out = {**environment(), "command": _command}
    if weights is not None:
        out["weights_sha256"] = ({str(k): weights_sha256(v) for k, v in weights.items()}
                                 if isinstance(weights, dict) else weights_sha256(weights))
    out["data_sha256"] = files_sha256(data_files)
    out.update(more)
    return out
