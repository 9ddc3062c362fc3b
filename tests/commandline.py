"""The ntkscope command run in this process: the same ``main()`` a user's ``ntkscope`` calls,
without paying a new interpreter's imports (about 5 s) per call. Tests that must see a real
process (kills, the first run of a command as a user types it) use ``subprocess`` instead."""

import contextlib
import io
import subprocess
from pathlib import Path

from ntkscope.app.cli import main


def in_process(*args) -> subprocess.CompletedProcess:
    """``ntkscope -q ARGS`` in this process: exit code, stdout and stderr as ``subprocess.run`` gives them."""
    argv = ["-q", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def _refuse(constant):
    raise ValueError(f"not RFC 8259 JSON: {constant}")


def strict_json_load(path):
    """A JSON file parsed as a strict reader would: NaN, Infinity and -Infinity refused."""
    import json

    return json.loads(Path(path).read_text(), parse_constant=_refuse)
