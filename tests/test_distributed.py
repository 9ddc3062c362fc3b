"""NTK, eigenpairs and GC across processes: 2 gloo processes on CPU (torch.multiprocessing)
equal one process in float64; n is odd, and one case leaves a rank with no samples. The
command under torchrun writes the same files as one process, and a run whose rank is
killed ends with an error and no result."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ntkscope as ns
from ntkscope.app.cli import main
from ntkscope.kernel.distributed import shard
from ntkscope.kernel.uncertainty import Resampling

RESAMPLING = Resampling(resamples=30, null_draws=10)
SUBSET = [0, 2, 3, 6]


def _model():
    from cse_models import GPT, GPTConfig

    previous = torch.get_default_dtype()  # the same weights in every process, whatever its default dtype
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16)).double().eval()
    finally:
        torch.set_default_dtype(previous)


def _batch(n):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (n, 9), generator=g)
    mask = torch.ones_like(ids)
    if n > 2:
        mask[1, 5:] = 0
        mask[n - 1, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _everything():
    """Every quantity under test, as plain tensors and floats, in one process or across several."""
    model, batch, other = _model(), _batch(7), _batch(3)
    out = {}
    for method in ("exact", "structured"):
        res = ns.empirical_ntk(model, batch, method=method, blocks="layer", dtype="float64")
        out[f"{method}/matrix"] = res.matrix
        out.update({f"{method}/block/{k}": v for k, v in res.blocks.items()})
        out[f"{method}/cross"] = ns.empirical_ntk(model, batch, other, method=method, dtype="float64").matrix
        out[f"{method}/one"] = ns.empirical_ntk(model, _batch(1), method=method, dtype="float64").matrix  # rank 1: none
        eig = ns.ntk_top_eigenpair(model, batch, method=method, dtype="float64")
        out[f"{method}/eigenvalue"], out[f"{method}/eigenvector"] = eig.eigenvalue, torch.as_tensor(eig.eigenvector)
        gc = ns.gradient_consistency(model, batch, SUBSET, method=method, dtype="float64", resampling=RESAMPLING)
        out[f"{method}/gc"] = torch.tensor([gc.score, gc.abs_interval.low, gc.abs_interval.high, gc.null.high,
                                            gc.mean_gradient])
    projected = {"method": "projected", "dtype": "float64", "projection_dim": 24, "seed": 3}
    res = ns.empirical_ntk(model, batch, blocks="layer", **projected)  # the same seeded R on every rank
    out["projected/matrix"] = res.matrix
    out.update({f"projected/block/{k}": v for k, v in res.blocks.items()})
    out["projected/cross"] = ns.empirical_ntk(model, batch, other, **projected).matrix
    out["projected/one"] = ns.empirical_ntk(model, _batch(1), **projected).matrix
    eig = ns.ntk_top_eigenpair(model, batch, method="matrix-free", dtype="float64", tol=1e-10)
    out["matrix-free/eigenvalue"], out["matrix-free/eigenvector"] = eig.eigenvalue, torch.as_tensor(eig.eigenvector)
    gc = ns.gradient_consistency(model, batch, SUBSET, method="matrix-free", dtype="float64", resampling=None,
                                 tol=1e-10)
    out["matrix-free/gc"] = torch.tensor([gc.score, gc.mean_gradient])
    out["direction"] = ns.principal_direction(model, batch, method="matrix-free", dtype="float64", tol=1e-10).vector
    return out


def _worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        result = _everything()
        rows = _rows_formed(lambda: ns.empirical_ntk(_model(), _batch(7), method="projected", dtype="float64"))
        every = [None] * size
        dist.all_gather_object(every, rows)
        sub = _in_subpanels()
        if rank == 0:
            torch.save({**result, "rows formed per rank": every, "sub-panels": sub}, path)
    finally:
        dist.destroy_process_group()


def _in_subpanels() -> dict:
    """Exact and structured kernels (with blocks, and a cross-kernel) with each rank's shard cut
    into sub-panels of m = 1 and 2 samples, as a budget too small for a whole shard cuts it,
    with the passes they took."""
    from ntkscope.kernel import distributed

    model, batch, other = _model(), _batch(7), _batch(3)
    original, out = distributed._subpanel_size, {}
    try:
        for m in (1, 2):
            distributed._subpanel_size = lambda largest, fits, what, m=m: min(largest, m)
            for method in ("exact", "structured"):
                res = ns.empirical_ntk(model, batch, method=method, blocks="layer", dtype="float64")
                out[f"{m}/{method}/matrix"], out[f"{m}/{method}/passes"] = res.matrix, res.gradient_passes
                out.update({f"{m}/{method}/block/{k}": v for k, v in res.blocks.items()})
                out[f"{m}/{method}/cross"] = ns.empirical_ntk(model, batch, other, method=method, dtype="float64").matrix
    finally:
        distributed._subpanel_size = original
    return out


def _rows_formed(call) -> int:
    """How many rows of J this process formed during ``call()`` (the sketch's per-sample gradients)."""
    from ntkscope.kernel import kernels

    count, original = [0], kernels.jacobian_rows

    def counted(fm, data, out, first_row=0):
        count[0] += out.shape[0]
        return original(fm, data, out, first_row)

    kernels.jacobian_rows = counted
    try:
        call()
    finally:
        kernels.jacobian_rows = original
    return count[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shards_cover_the_samples_in_order():
    assert [shard(7, r, 2) for r in range(2)] == [slice(0, 4), slice(4, 7)]
    assert [shard(1, r, 2) for r in range(2)] == [slice(0, 1), slice(1, 1)]  # the second rank holds none
    assert [shard(5, r, 3) for r in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 5)]
    from ntkscope.kernel.distributed import _subpanel_size, _subpanels

    # a whole shard when two fit the budget, else what fits, at least one sample
    assert [_subpanel_size(4, fits, "exact") for fits in (9, 4, 3, 0, -2)] == [4, 4, 3, 1, 1]
    assert _subpanels(7, 3, 2) == [[slice(0, 3), slice(3, 4)], [slice(4, 7)]]
    assert _subpanels(1, 3, 2) == [[slice(0, 1)], []]


def test_two_gloo_processes_equal_one(tmp_path):
    path = tmp_path / "distributed.pt"
    mp.spawn(_worker, args=(2, _free_port(), str(path)), nprocs=2, join=True)
    got, want = torch.load(path), _everything()
    assert got.pop("rows formed per rank") == [4, 3]  # projected is sharded: each rank sketches its own samples
    sub = got.pop("sub-panels")  # shards of 4 and 3 samples in sub-panels of 1 and 2: 4 and 2 passes
    assert {k: v for k, v in sub.items() if k.endswith("passes")} == {
        f"{m}/{method}/passes": 4 // m for m in (1, 2) for method in ("exact", "structured")}
    for key, value in sub.items():
        if not key.endswith("passes"):
            torch.testing.assert_close(value, want[key.split("/", 1)[1]], rtol=1e-10, atol=1e-10, msg=key)
    assert got.keys() == want.keys()
    for key, value in want.items():
        g = got[key]
        if key.endswith("eigenvector") or key == "direction":  # up to sign
            g = g * torch.sign(torch.dot(torch.as_tensor(g).double().flatten(), torch.as_tensor(value).double().flatten()))
        # Lanczos to its tolerance; GC's eigenvectors of 4-sample sub-kernels turn kernels equal to 1e-10 into
        # values equal to about 1e-8 (measured 2e-8), their conditioning
        tol = 1e-7 if key.startswith("matrix-free") or key == "direction" or key.endswith("/gc") else 1e-10
        torch.testing.assert_close(torch.as_tensor(g).double(), torch.as_tensor(value).double(), rtol=tol, atol=tol,
                                   msg=key)


def _torchrun(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(_free_port()), "-m", "ntkscope", "--", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from cse_models import GPT, GPTConfig

    root = tmp_path_factory.mktemp("dist")
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=2, n_embd=16)).save_pretrained(root / "gpt")
    return root / "gpt"


def test_gc_under_torchrun_writes_what_one_process_writes(checkpoint, tmp_path):
    args = ["gc", checkpoint, "--n", 33, "--seq-len", 16, "--bins", 3, "--method", "structured", "--dtype", "float64",
            "--resamples", 40, "--null-draws", 20]
    proc = _torchrun("-q", *args, "--out", tmp_path / "two")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert stdout.count("GC of each frequency bin") == 1  # rank 0 prints, once
    assert main(["-q", *map(str, args), "--out", str(tmp_path / "one")]) == 0  # one process
    a, b = pd.read_csv(tmp_path / "one" / "gc.csv"), pd.read_csv(tmp_path / "two" / "gc.csv")
    pd.testing.assert_frame_equal(a, b, rtol=1e-9)


def _rank_pid(marker: str, rank: int):
    """The pid of the torchrun worker of ``rank`` whose command line holds ``marker``, or None."""
    for proc in Path("/proc").iterdir():
        try:
            if marker in (proc / "cmdline").read_bytes().decode(errors="replace") and \
                    f"RANK={rank}\x00".encode() in (proc / "environ").read_bytes() and \
                    b"GROUP_RANK=" in (proc / "environ").read_bytes():
                return int(proc.name)
        except (OSError, ValueError):
            continue
    return None


def test_a_killed_rank_ends_the_run_with_an_error_and_no_result(checkpoint, tmp_path):
    out = tmp_path / "killed"
    proc = _torchrun("gc", checkpoint, "--n", 512, "--seq-len", 32, "--method", "exact", "--resamples", 10000,
                     "--out", out)  # about 20 s on an idle 2-core machine: the kill lands mid-run
    deadline, pid = time.time() + 120, None
    while time.time() < deadline and pid is None:
        time.sleep(0.5)
        pid = _rank_pid(str(out), 1)
    assert pid is not None, "rank 1 did not start"
    time.sleep(4)  # mid-run: the workers are loading, computing the kernel, or resampling
    assert proc.poll() is None, "the run ended before the kill"
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "ChildFailedError" in stderr and "Signal 9 (SIGKILL)" in stderr, stderr[-2000:]
    assert not out.exists()  # nothing half-written


def _nccl_worker(rank, port, path):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model, batch = _model(), _batch(7)
        out = {m: ns.empirical_ntk(model, batch, method=m, dtype="float64", device="cuda").matrix.cpu()
               for m in ("exact", "structured")}
        gc = ns.gradient_consistency(model, batch, SUBSET, method="matrix-free", dtype="float64", device="cuda",
                                     resampling=None, tol=1e-10)
        out["gc"] = torch.tensor([gc.score, gc.mean_gradient], dtype=torch.float64)
        torch.save(out, path)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_with_one_rank_matches_the_cpu(tmp_path):
    path = tmp_path / "nccl.pt"
    mp.spawn(_nccl_worker, args=(_free_port(), str(path)), nprocs=1, join=True)
    got = torch.load(path)
    model, batch = _model(), _batch(7)
    for method in ("exact", "structured"):
        want = ns.empirical_ntk(model, batch, method=method, dtype="float64").matrix
        torch.testing.assert_close(got[method], want, rtol=1e-9, atol=1e-12, msg=method)
    gc = ns.gradient_consistency(model, batch, SUBSET, method="matrix-free", dtype="float64", resampling=None, tol=1e-10)
    torch.testing.assert_close(got["gc"], torch.tensor([gc.score, gc.mean_gradient], dtype=torch.float64),
                               rtol=1e-7, atol=1e-7)


def test_torchrun_takes_gc_and_ntk_on_one_checkpoint_only(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["-q", "freq"]) == 1
    assert "ntkscope freq: error: command must be gc or ntk under torchrun (got 'freq')" in capsys.readouterr().err
    assert main(["-q", "gc", str(tmp_path / "run")]) == 1
    assert "target must be one checkpoint under torchrun" in capsys.readouterr().err
