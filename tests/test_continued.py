"""A run continued by another arm (cse_models.continued): a transformers Trainer checkpoint's
AdamW state and schedule, read without running its pickles, carried into a cse_models branch;
one step from the branch equals Trainer's own next step; what cannot be continued says why."""

import json

import pytest
import torch

from cse_models import load_any_model
from cse_models.checkpointing import load_optimizer_state
from cse_models.continued import branch, read_training_args, run_state
from cse_models.train import lr_factor, make_optimizer
from cse_models.train_config import TrainConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from test_hf_sparse import dense, planted_domains  # noqa: E402

ROWS = planted_domains(n_per=4, T=16)[0]  # 8 rows: every step's batch is all of them


def _trainer_run(out, schedule: str, **kw):
    torch.set_default_dtype(torch.float32)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=8, per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=2,
        lr_scheduler_type=schedule, weight_decay=0.1, adam_beta2=0.99, max_grad_norm=0.5, save_steps=1,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **kw)
    data = [{"input_ids": r, "labels": r} for r in ROWS]
    transformers.Trainer(model=dense("llama").train(), args=args, train_dataset=data).train()


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_branch_from_a_trainer_checkpoint_takes_trainers_next_step(schedule, tmp_path):
    _trainer_run(tmp_path / "hf", schedule)
    state, why = run_state(tmp_path / "hf" / "checkpoint-4")
    assert why == "" and state.writer == "Trainer" and state.step == 4
    assert state.schedule == {"lr": 3e-3, "lr_schedule": schedule, "min_lr_ratio": 0.0, "warmup_steps": 2,
                              "steps": 8, "weight_decay": 0.1, "betas": [0.9, 0.99], "grad_clip": 0.5}
    cfg = TrainConfig(out_dir=str(tmp_path / "arm"), **state.schedule)
    start = branch(tmp_path / "hf" / "checkpoint-4", tmp_path / "arm", None, cfg, state)
    assert start.name == "step-000004"
    model = load_any_model(start).train()
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    assert load_optimizer_state(start, model, opt, sched) == 4
    logged = {row["step"]: row["learning_rate"] for row in json.loads(
        (tmp_path / "hf" / "checkpoint-8" / "trainer_state.json").read_text())["log_history"] if "learning_rate" in row}
    assert opt.param_groups[0]["lr"] == pytest.approx(logged[5], rel=1e-6)  # the rate Trainer's step 5 used
    loss = model.hf(input_ids=ROWS, labels=ROWS).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    after = load_any_model(tmp_path / "hf" / "checkpoint-5").hf.state_dict()
    for name, value in model.hf.state_dict().items():
        torch.testing.assert_close(value, after[name], rtol=1e-5, atol=1e-6, msg=name)


def test_what_cannot_be_continued_says_why(tmp_path):
    _trainer_run(tmp_path / "hf", "cosine_with_restarts")
    state, why = run_state(tmp_path / "hf" / "checkpoint-4")
    assert state is None and "cosine_with_restarts" in why
    _trainer_run(tmp_path / "lin", "linear")
    assert "step 1 is inside its warm-up of 2 steps" in run_state(tmp_path / "lin" / "checkpoint-1")[1]
    assert read_training_args(tmp_path / "hf" / "checkpoint-4" / "training_args.bin")["learning_rate"] == 3e-3
    dense("llama").save_pretrained(tmp_path / "bare")
    assert run_state(tmp_path / "bare") == (None, "it holds no optimizer state (a model directory, or a checkpoint "
                                                  "saved without it)")
    (tmp_path / "hf" / "checkpoint-4" / "scheduler.pt").unlink()
    assert "lacks scheduler.pt" in run_state(tmp_path / "hf" / "checkpoint-4")[1]


def test_training_args_are_read_without_running_the_pickle(tmp_path):
    """A training_args.bin whose pickle would run code on loading: read as inert records, the code
    never runs."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    args.evil = Evil()
    torch.save(args, tmp_path / "training_args.bin")
    fields = read_training_args(tmp_path / "training_args.bin")
    assert not marker.exists() and fields["lr_scheduler_type"] == "linear"


def test_pickle_extension_codes_are_refused_not_looked_up(tmp_path):
    """An EXT opcode is resolved through copyreg's registry (and its cache), not find_class: a
    training_args.bin that uses one is refused before anything is unpickled."""
    import copyreg
    import os
    import pickle

    function = os.getcwd
    key = (function.__module__, function.__name__)
    copyreg.add_extension(*key, 240)
    try:
        data = pickle.dumps(function, protocol=2)
    finally:
        copyreg.remove_extension(*key, 240)
    assert data[2:3] == b"\x82"  # EXT1
    (tmp_path / "training_args.bin").write_bytes(data)
    with pytest.raises(ValueError, match="uses pickle extension codes"):
        read_training_args(tmp_path / "training_args.bin")


def test_damaged_trainer_files_are_a_reason_never_a_traceback(tmp_path):
    """training_args.bin with a huge int, inf or a beta of 2; scheduler.pt holding a list;
    optimizer.pt with another exp_avg_sq shape, or not a state dict: each one reason naming the file."""
    import shutil

    _trainer_run(tmp_path / "hf", "linear")
    source = tmp_path / "hf" / "checkpoint-4"
    real = torch.load(source / "training_args.bin", weights_only=False)  # our own file, in a test

    def variant(name, change):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        change(folder)
        return run_state(folder)

    def args_with(**fields):
        def change(folder):
            for key, value in fields.items():
                object.__setattr__(real, key, value)
            torch.save(real, folder / "training_args.bin")
        return change

    originals = {k: getattr(real, k) for k in ("adam_beta1", "learning_rate")}
    for name, fields, said in [("beta", {"adam_beta1": 2.0}, "adam_beta1 must be a finite number in [0.0, 1.0) (got 2.0)"),
                               ("huge", {"learning_rate": 10**400}, "learning_rate must be a finite number in "
                                "[0.0, inf) (got an integer of 401 digits)"),
                               ("inf", {"learning_rate": float("inf")}, "learning_rate must be a finite number")]:
        state, why = variant(name, args_with(**{**originals, **fields}))
        assert state is None and said in why, why
    args_with(**originals)(tmp_path)  # back to the real values for the other files' variants

    state, why = variant("build", lambda f: (f / "training_args.bin").write_bytes(b"\x80\x02}q\x00}q\x01b."))
    assert state is None and why.startswith("its training_args.bin could not be read")  # a pickle that BUILDs a dict
    state, why = variant("sched", lambda f: torch.save([1, 2], f / "scheduler.pt"))
    assert state is None and "its scheduler.pt records no learning rate" in why

    def other_shape(folder):
        saved = torch.load(folder / "optimizer.pt", weights_only=True)
        first = next(iter(saved["state"]))
        saved["state"][first]["exp_avg_sq"] = torch.zeros(3)
        torch.save(saved, folder / "optimizer.pt")

    state, why = variant("shape", other_shape)
    assert state is None and "has shapes" in why and "(3,)" in why
    state, why = variant("garbage", lambda f: (f / "optimizer.pt").write_bytes(b"not a zip"))
    assert state is None and why.startswith("its optimizer.pt could not be read")
    state, why = variant("list", lambda f: torch.save([1], f / "optimizer.pt"))
    assert state is None and "does not hold an optimizer's state_dict" in why
