"""``max_memory`` is kept: the peak resident memory above the loaded model stays within the budget
for exact, structured and projected, in one process and in each of two ranks, with budgets small
enough that exact and structured run in panels; a budget below the smallest that works is
refused before anything runs, and that smallest budget (with the probe's noise) runs.

The peak is read from the kernel's own counter (``VmHWM``, reset at the start): Linux only. The
process first computes each method once on two samples, as the first call of a code path pages
in tens of MB of library code that stays (not data, and the same for any budget).

The peaks are measured in a fresh interpreter that collects this file alone
(:func:`test_in_a_fresh_process`): freed memory that earlier tests (or the collection of every
test module) leave in glibc's heap counts in a peak, by about a MiB, which is the margin these
budgets have."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ntkscope as ns
from cse_models import GPT, GPTConfig
from ntkscope.core.memory import PeakMemory

CHILD = "NTKSCOPE_MEMORY_CHILD"
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc (Linux)")]
measures = pytest.mark.skipif(not os.environ.get(CHILD), reason="measured in test_in_a_fresh_process")


@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="this is the fresh process")
def test_in_a_fresh_process():
    """Every measuring test of this file, in a process of its own (one thread, as an xdist worker)."""
    env = {**os.environ, CHILD: "1", "PYTEST_XDIST_WORKER": "gw0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k",
                           "one_process or methods_agree or budget_below"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout

MiB = 2**20
#: (method, budget): exact and structured need panels under these (their whole kernels need more)
CASES = [("exact", 64 * MiB), ("structured", 32 * MiB), ("structured", 64 * MiB), ("projected", 160 * MiB)]
K = 128  # projected's columns: its tiles of R are drawn again for every chunk of samples


def _model_and_batch():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (32, 32), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _warm(model, batch):
    two = {k: v[:2] for k, v in batch.items()}
    for method in ("exact", "structured", "projected"):
        ns.empirical_ntk(model, two, method=method, dtype="float32", projection_dim=K)


def _peaks(model, batch) -> dict:
    """{(method, budget): (peak bytes, gradient passes, NTKResult)} for every case."""
    out = {}
    for method, budget in CASES:
        with PeakMemory() as mem:
            res = ns.empirical_ntk(model, batch, method=method, dtype="float32", max_memory=budget, projection_dim=K)
        out[(method, budget)] = (mem.bytes, res.gradient_passes, res)
    return out


@pytest.fixture(scope="module")
def measured():
    model, batch = _model_and_batch()
    _warm(model, batch)
    return _peaks(model, batch)


@measures
@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{b // MiB}MiB" for m, b in CASES])
def test_one_process_stays_within_max_memory(measured, case):
    peak, passes, _ = measured[case]
    assert 0 < peak <= case[1], f"{case[0]}: peak {peak / MiB:.1f} MiB above the model, budget {case[1] / MiB:.0f} MiB"
    if case[0] != "projected":
        assert passes > 1  # the budget made it run in panels


@measures
def test_methods_agree_under_their_budgets(measured):
    exact = measured[("exact", 64 * MiB)][2].matrix
    for case in CASES[1:3]:
        torch.testing.assert_close(measured[case][2].matrix, exact, rtol=2e-4, atol=1e-5 * float(exact.abs().max()))
    sketch = measured[("projected", 160 * MiB)][2]  # within its JL bound: |error| <= eps |g_i| |g_j|
    scale = torch.sqrt(torch.outer(exact.diagonal(), exact.diagonal()))
    assert bool(((sketch.matrix - exact).abs() <= sketch.error_bound * scale).all())


@measures
def test_a_budget_below_the_smallest_is_refused_and_the_smallest_runs():
    model, batch = _model_and_batch()
    _warm(model, batch)
    for method in ("exact", "structured"):
        with pytest.raises(ValueError, match=rf"max_memory is too small for method='{method}' here: it needs at "
                                             r"least [\d.]+ MiB") as refused:
            ns.empirical_ntk(model, batch, method=method, dtype="float32", max_memory=4 * MiB)
        need = float(re.search(r"at least ([\d.]+) MiB", str(refused.value)).group(1)) * MiB
        budget = 2 * int(need)  # each call measures its probe again, and small peaks vary by pages
        with PeakMemory() as mem:
            ns.empirical_ntk(model, batch, method=method, dtype="float32", max_memory=budget)
        assert mem.bytes <= budget, (method, mem.bytes / MiB, budget / MiB)
    with pytest.raises(ValueError, match=r"max_memory is too small for any method that can do this; the smallest "
                                         r"that would do: [\d.]+ MiB \(method='(exact|structured)'\)"):
        ns.empirical_ntk(model, batch, dtype="float32", max_memory=2 * MiB)


def _worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        model, batch = _model_and_batch()
        _warm(model, batch)
        peaks = {f"{m}/{b}": (p, passes) for (m, b), (p, passes, _) in _peaks(model, batch).items()}
        every = [None] * size
        dist.all_gather_object(every, peaks)
        if rank == 0:
            torch.save(every, path)
    finally:
        dist.destroy_process_group()


def test_two_ranks_each_stay_within_max_memory(tmp_path):
    from test_distributed import _free_port

    path = Path(tmp_path) / "peaks.pt"
    mp.spawn(_worker, args=(2, _free_port(), str(path)), nprocs=2, join=True)
    for rank, peaks in enumerate(torch.load(path)):
        for method, budget in CASES:
            peak, passes = peaks[f"{method}/{budget}"]
            assert 0 < peak <= budget, f"rank {rank}, {method}: {peak / MiB:.1f} MiB above the model, " \
                                       f"budget {budget / MiB:.0f} MiB"


def _python(script: Path) -> subprocess.CompletedProcess:
    """``script`` run by this Python in a fresh process (malloc's state is per process)."""
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)


def test_memory_freed_before_the_first_computation_is_named(tmp_path):
    """Blocks freed before ntkscope's first kernel computation stay in glibc's heap, where later
    small allocations creep over them: the first call says how much, and what to do."""
    script = tmp_path / "freed.py"
    script.write_text(
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "big = torch.ones(5 * 2**20); del big  # freed: glibc's mmap threshold rises to 20 MiB\n"
        "blocks = [torch.ones(2**19) for _ in range(300)]  # 2 MiB each, now from the heap\n"
        "del blocks[::2]  # 300 MiB freed between live blocks\n"
        "import ntkscope\n"
        "ntkscope.hand_back_freed_memory()\n")
    proc = _python(script)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"malloc's heap holds ([\d.]+) MiB freed before ntkscope's first kernel computation.*"
                      r"Call ntkscope.hand_back_freed_memory\(\) at the start of the program", proc.stderr)
    assert found and 250 < float(found.group(1)) < 350, proc.stderr
    # a program that trains first by design (ntkscope reproduce): the freed pages go back, nothing to advise
    rss = "int(open('/proc/self/statm').read().split()[1]) * 4096 // 2**20"
    script.write_text(script.read_text().replace("logging.WARNING", "logging.INFO").replace(
        "import ntkscope\n", f"import ntkscope\nbefore = {rss}\n"
        "from ntkscope.core.memory import trains_before_analysing\ntrains_before_analysing()\n")
        + f"print('MiB handed back', before - {rss})\n")
    proc = _python(script)
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr
    assert "handed back to the system" in proc.stderr, proc.stderr
    assert int(proc.stdout.split("MiB handed back")[1]) > 200, proc.stdout  # the resident set fell


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc thresholds")
def test_training_after_a_kernel_computation_gets_a_training_loops_malloc_back(tmp_path):
    """A kernel computation fixes glibc's mmap threshold at 1 MiB (a freed 8 MiB block leaves the
    resident set at once); before training steps that follow it (a tracker's probe, a run after
    an analysis) the thresholds go where a training loop's settle (the block stays in the heap,
    reused by the next step), and the next kernel computation fixes them again. After
    hand_back_freed_memory() they stay fixed for the whole process."""
    script = tmp_path / "thresholds.py"
    script.write_text(
        "import torch, ntkscope as ns\n"
        "from ntkscope.core import memory\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "def kept(mib):  # MiB of a freed block still resident\n"
        "    before = rss(); x = torch.ones(mib * 2**18); del x; return round((rss() - before) / 2**20)\n"
        "model = torch.nn.Linear(3, 1)\n"
        "def kernel(): ns.empirical_ntk(model, torch.randn(4, 3), output=lambda m, x: m(x)[:, 0])\n"
        "kernel(); print('kernel', kept(8))\n"
        "memory.training_thresholds(); print('training', kept(8))\n"
        # a larger block each time after: the freed 8 MiB may sit in malloc's bins, and a block
        # of its size is taken from there (resident again) whatever the threshold
        "kernel(); print('kernel', kept(16))\n"
        "ns.hand_back_freed_memory(); memory.training_thresholds(); print('pinned', kept(24))\n")
    proc = _python(script)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[::2] == ["kernel", "training", "kernel", "pinned"], proc.stdout
    kept = [int(w) for w in words[1::2]]
    assert kept[0] <= 1 and kept[1] >= 6 and kept[2] <= 1 and kept[3] <= 1, proc.stdout
