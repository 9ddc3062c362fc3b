"""Whatever a user feeds it: one line and exit status 1, nothing left behind, locks on run
directories, resume past a damaged checkpoint, and kills that lose nothing."""

import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commandline import one_line_error
import torch
from safetensors.torch import load_file

from cse_models import GPT, GPTConfig
from cse_models.evaluate import main as cse_eval
from cse_models.train import TrainConfig, main as cse_train, train
from ntkscope.app.cli import main as ntkscope
from ntkscope.core.files import DirectoryLock
from ntkscope.text.corpus.pack import DEFAULT_PACK, load_pack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")




@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ckpt")
    model = GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=2, n_embd=16))
    model.save_pretrained(root / "good")
    shutil.copy(DEFAULT_PACK / "tokenizer.json", root / "good" / "tokenizer.json")
    return root / "good"


def _variant(checkpoint, tmp_path, name, *, weights=None, config=None):
    out = tmp_path / name
    shutil.copytree(checkpoint, out)
    if weights is not None:
        (out / "model.safetensors").write_bytes(weights)
    if config is not None:
        (out / "config.json").write_text(config)
    return out


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_a_damaged_safetensors_file_is_one_line_in_every_command(checkpoint, tmp_path, capsys, damage):
    data = (checkpoint / "model.safetensors").read_bytes()
    bad = {"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x00" * 64 + b"not safetensors"}[damage]
    ckpt = _variant(checkpoint, tmp_path, damage, weights=bad)
    for command in (["ntk", ckpt, "--n", 4], ["gc", ckpt, "--n", 8], ["clusters", ckpt, "--n", 8]):
        err = one_line_error(capsys, ntkscope, "-q", *command)
        assert "model.safetensors" in err and ("not a readable safetensors file" in err or "is empty" in err), err
    err = one_line_error(capsys, cse_eval, f"m={ckpt}")
    assert "model.safetensors" in err


def test_a_config_that_is_not_an_object_or_too_big_is_one_line(checkpoint, tmp_path, capsys):
    listed = _variant(checkpoint, tmp_path, "list", config="[1, 2, 3]")
    assert "config.json must hold a JSON object (got list)" in one_line_error(capsys, ntkscope, "ntk", listed)
    config = json.loads((checkpoint / "config.json").read_text())
    for n_embd, expect in ((10**9, "2.4e+19 parameters (83.3 EiB in float32)"), (65536, "1.0e+11 parameters (386.")):
        huge = _variant(checkpoint, tmp_path, f"huge-{n_embd}", config=json.dumps({**config, "n_embd": n_embd,
                                                                                    "n_head": 1}))
        start = time.perf_counter()
        err = one_line_error(capsys, ntkscope, "-q", "ntk", huge)
        assert "config.json asks for" in err and expect in err and "free" in err, err
        assert time.perf_counter() - start < 5  # refused from the config, nothing allocated


def test_the_pickle_refusal_names_the_global(checkpoint, tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    evil = _variant(checkpoint, tmp_path, "evil")
    (evil / "model.safetensors").unlink()
    torch.save({"w": Evil()}, evil / "pytorch_model.bin")
    err = one_line_error(capsys, ntkscope, "ntk", evil)
    assert "is a pickle that would run code, refused, never executed (it imports posix.system)" in err
    assert "pwned" not in capsys.readouterr().out


def test_out_is_checked_before_any_work(checkpoint, tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    start = time.perf_counter()
    err = one_line_error(capsys, ntkscope, "gc", checkpoint, "--out", taken)
    assert err == f"ntkscope gc: error: gc: --out {taken} exists and is not a directory"
    assert time.perf_counter() - start < 5 and taken.read_text() == "mine"
    err = one_line_error(capsys, ntkscope, "clusters", checkpoint, "--out", tmp_path / "table.txt")
    assert "must end in .csv or .parquet" in err


def test_malformed_training_configs_are_one_line(tmp_path, capsys):
    bad = tmp_path / "run.yaml"
    bad.write_text("steps: 10\nmodel: {n_layer: 2\n")
    assert "is not valid YAML (line" in one_line_error(capsys, cse_train, bad)
    bad.write_text("- 1\n- 2\n")
    assert "must hold a mapping of settings (got list)" in one_line_error(capsys, cse_train, bad)
    bad.write_text("model: {n_embd: 1000000000, n_head: 1}\nsteps: 2\ndata: {seq_len: 16}\n")
    err = one_line_error(capsys, cse_train, bad, "--out-dir", tmp_path / "never")
    assert "TrainConfig: model asks for 2.4e+19 parameters" in err and "free" in err


def _damaged_pack(tmp_path, name, edit):
    """A copy of the shipped pack whose manifest hashes match the damaged content."""
    pack = tmp_path / name
    shutil.copytree(DEFAULT_PACK, pack)
    edit(pack)
    manifest = json.loads((pack / "manifest.json").read_text())
    for file, info in manifest.get("files", {}).items():
        info["sha256"] = hashlib.sha256((pack / file).read_bytes()).hexdigest()
    (pack / "manifest.json").write_text(json.dumps(manifest))
    return pack


def test_damaged_packs_name_the_file(tmp_path):
    def truncate(pack):
        data = (pack / "validation.jsonl.gz").read_bytes()
        (pack / "validation.jsonl.gz").write_bytes(data[: len(data) // 2])

    def bad_line(pack):
        rows = gzip.decompress((pack / "validation.jsonl.gz").read_bytes()).decode().splitlines()
        rows[3] = "{not json"
        (pack / "validation.jsonl.gz").write_bytes(gzip.compress("\n".join(rows).encode()))

    def no_files(pack):
        manifest = json.loads((pack / "manifest.json").read_text())
        del manifest["files"]
        (pack / "manifest.json").write_text(json.dumps(manifest))

    with pytest.raises(ValueError, match=r"validation.jsonl.gz is damaged \(EOFError"):
        load_pack(_damaged_pack(tmp_path, "truncated", truncate)).records("validation")
    with pytest.raises(ValueError, match=r"validation.jsonl.gz line 4 is not valid JSON"):
        load_pack(_damaged_pack(tmp_path, "bad-line", bad_line)).records("validation")
    with pytest.raises(ValueError, match=r"manifest.json lacks \['files'\]: the pack is damaged"):
        load_pack(_damaged_pack(tmp_path, "no-files", no_files))


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    with DirectoryLock(run, "test"):
        err = one_line_error(capsys, ntkscope, "-q", "reproduce", "--smoke", "--out", run)
        assert f"is in use by another process (pid {os.getpid()}: test)" in err
        with pytest.raises(ValueError, match="is in use by another process"):
            train(TrainConfig.from_dict({"out_dir": str(run), "steps": 1}))
    assert not run.exists()  # made by the lock, refused runs wrote nothing: nothing is left behind
    run.mkdir()
    (run / DirectoryLock.NAME).write_text("pid 999999: a process that was killed\n")  # no flock held
    with DirectoryLock(run, "test") as lock:
        assert (run / DirectoryLock.NAME).read_text() == f"pid {os.getpid()}: test\n" and lock
        (run / "result.csv").write_text("a\n1\n")
    assert sorted(p.name for p in run.iterdir()) == ["result.csv"]  # the lock file goes, the results stay


def _tiny_config(tmp_path, name, **changes):
    return {"out_dir": str(tmp_path / name), "model": {"n_layer": 1, "n_embd": 16, "n_head": 2},
            "data": {"seq_len": 16, "split": "validation"}, "steps": 40, "batch_size": 4, "checkpoint_every": 10,
            "log_every": 1, "warmup_steps": 2, "seed": 3, **changes}


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, caplog):
    torch.set_default_dtype(torch.float32)
    full = train(TrainConfig.from_dict(_tiny_config(tmp_path, "full", steps=20)))
    partial = TrainConfig.from_dict(_tiny_config(tmp_path, "damaged", steps=20))
    train(TrainConfig.from_dict({**_tiny_config(tmp_path, "damaged"), "steps": 20}))
    last = tmp_path / "damaged" / "checkpoints" / "step-000020"
    data = (last / "model.safetensors").read_bytes()
    (last / "model.safetensors").write_bytes(data[:100])  # the newest checkpoint is damaged
    caplog.set_level("WARNING")
    resumed = train(partial)  # redoes steps 11-20 from step-000010
    assert "checkpoint step-000020 is damaged" in caplog.text and "falling back" in caplog.text
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _metrics_steps(run: Path) -> list:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("when", ["after a checkpoint",
                                  pytest.param("between checkpoints", marks=pytest.mark.slow)])  # CI time: -m slow
def test_sigkilled_training_resumes_to_the_uninterrupted_weights(tmp_path, when):
    torch.set_default_dtype(torch.float32)
    spec = _tiny_config(tmp_path, "killed", steps=200, checkpoint_every=50)
    (tmp_path / "run.json").write_text(json.dumps(spec))
    threads = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # bit-equal: the same summation order
    proc = subprocess.Popen([sys.executable, "-m", "cse_models.train", str(tmp_path / "run.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=threads)
    run, deadline = tmp_path / "killed", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        done = (run / "checkpoints" / "step-000050").is_dir()
        if when == "after a checkpoint" and done:
            break
        if when == "between checkpoints" and any(75 <= s < 100 for s in _metrics_steps(run)):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / "checkpoints" / "step-000050").is_dir() and not (run / "checkpoints" / "step-000200").is_dir()
    resumed = train(TrainConfig.from_dict(spec))
    full = train(TrainConfig.from_dict(_tiny_config(tmp_path, "full", steps=200, checkpoint_every=50)))
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics_steps(run) == _metrics_steps(tmp_path / "full")  # the log rewound to the checkpoint


@pytest.mark.slow  # 15 s of CI time for one flag; run with -m slow
def test_quiet_silences_transformers_too(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=16,
                                                                 n_layer=1, n_head=2))  # bos/eos 50256: it warns
    model.save_pretrained(tmp_path / "hf")
    shutil.copy(DEFAULT_PACK / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    quiet = subprocess.run([sys.executable, "-m", "ntkscope", "-q", "ntk", str(tmp_path / "hf"), "--n", "4",
                            "--seq-len", "16"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr  # transformers warns about bos/eos unquieted
