"""The ntkscope command run in this process: the same ``main()`` a user's ``ntkscope`` calls,
without paying a new interpreter's imports (about 5 s) per call. Tests that must see a real
process (kills, the first run of a command as a user types it) use ``subprocess`` instead."""

import contextlib
import io
import json
import shutil
import subprocess
import tempfile
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


def one_line_error(capsys, run, *args) -> str:
    """Run a command in-process; it must fail with exit status 1 and one line on stderr, and
    leave no staging directory behind. The command gets a temp folder of its own, so that other
    test workers' staging directories cannot come or go in it meanwhile."""
    own = Path(tempfile.mkdtemp(prefix="one-line-"))
    saved, tempfile.tempdir = tempfile.tempdir, str(own)
    try:
        code = run([str(a) for a in args])
    finally:
        tempfile.tempdir = saved
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert len(err.splitlines()) == 1, err
    left = sorted(p.name for p in own.iterdir())
    shutil.rmtree(own)
    assert left == []  # nothing staged is left in the temp folder
    return err


def write_domain_rows(root, sizes: dict, domains=("legal", "biomedical", "general")) -> None:
    """``ROOT/SPLIT.jsonl`` for each ``{split: rows per domain}``: real text of the shipped pack,
    ``{"text", "domain"}`` per line."""
    from ntkscope.text.corpus.pack import load_pack

    pack = load_pack()
    for split, n in sizes.items():
        rows = [{"text": r.text, "domain": r.domain} for d in domains
                for r in [r for r in pack.records(split) if r.domain == d][:n]]
        (Path(root) / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
