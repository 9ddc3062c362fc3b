"""A Hugging Face ``Trainer``'s run as the researcher has it: its
``output_dir`` of ``checkpoint-N`` folders, with the final model saved beside them, is a run
directory to ``plan``, ``gc`` and ``compare``, each step read from ``trainer_state.json``."""

import json
import shutil

import pytest
import torch
from commandline import in_process, write_domain_rows

from ntkscope.runs.checkpoints import is_run_dir, list_checkpoints
from ntkscope.text.corpus.pack import DEFAULT_PACK, load_pack

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A tiny GPT-NeoX trained 6 steps by transformers.Trainer, saving every 2 steps, then
    ``save_model`` into its output_dir: the layout a Trainer script leaves."""
    root = tmp_path_factory.mktemp("trainer")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    tok = load_pack(None).tokenizer()
    write_domain_rows(root, {"train": 40, "test": 8})
    texts = [json.loads(line)["text"] for line in (root / "train.jsonl").read_text().splitlines()]
    blocks = [ids[:16] for ids in tok.encode(texts) if len(ids) >= 16][:48]
    data = [{"input_ids": torch.tensor(b), "labels": torch.tensor(b)} for b in blocks]
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                                        rotary_pct=0.25, bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(output_dir=str(root / "run"), max_steps=6, per_device_train_batch_size=8,
                                          learning_rate=3e-3, save_steps=2, logging_steps=2, report_to=[], use_cpu=True, seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=transformers.GPTNeoXForCausalLM(config), args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(root / "run"))  # the final model beside the checkpoints
    (root / "run" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    torch.set_default_dtype(previous)
    return root


def test_a_trainer_output_dir_is_a_run_with_the_steps_of_its_states(trainer_run, tmp_path):
    run = trainer_run / "run"
    assert is_run_dir(run) and (run / "config.json").is_file()  # the final model beside: still a run
    assert [(step, path.name) for step, path in list_checkpoints(run)] == \
        [(2, "checkpoint-2"), (4, "checkpoint-4"), (6, "checkpoint-6")]
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "checkpoint-4").rename(copy / "checkpoint-40")  # renamed by hand: its trainer state says the step
    assert [(step, path.name) for step, path in list_checkpoints(copy)][1] == (4, "checkpoint-40")
    assert not is_run_dir(run / "checkpoint-6")  # one checkpoint is one model


def test_plan_gc_and_compare_on_a_trainer_run(trainer_run, tmp_path):
    torch.set_default_dtype(torch.float32)
    run, rows = trainer_run / "run", trainer_run / "test.jsonl"
    common = ["--data", rows, "--label-column", "domain", "--n", 24, "--seq-len", 16]
    plan = in_process("plan", run, *common, "--top-k", 1, "--out", tmp_path / "plan.json")
    assert plan.returncode == 0, plan.stderr[-2000:]
    made = json.loads((tmp_path / "plan.json").read_text())
    assert made["source"]["steps"] == [2, 4, 6] and made["source"]["model_type"] == "gpt_neox"
    record = made["evidence"]["warmup_record"]  # the schedule's length from trainer_state.json's max_steps
    assert record["schedule_steps"] == 6 and record["cross_validated"]["step"] == 3
    assert record["measured_step"] == made["convert_at"] and "half the schedule is step 3" in plan.stdout
    by_fraction = in_process("plan", run, *common, "--top-k", 1, "--warmup-by", "schedule-fraction",
                             "--schedule-steps", 10, "--out", tmp_path / "plan-fraction.json")
    assert by_fraction.returncode == 0, by_fraction.stderr[-2000:]
    fraction = json.loads((tmp_path / "plan-fraction.json").read_text())
    page = in_process("report", tmp_path / "plan-fraction.json")  # a plan file: its own page beside it
    assert page.returncode == 0, page.stderr[-2000:]
    assert ">The plan</h2>" in (tmp_path / "plan-fraction.html").read_text()
    page = in_process("report", run, "--out", tmp_path / "run.html")  # a Trainer folder, no track/
    assert page.returncode == 0, page.stderr[-2000:]
    text = (tmp_path / "run.html").read_text()
    assert ">Training</h2>" in text and "6 steps; final training loss" in text
    assert (fraction["convert_at"], fraction["warmup_rule"]) == (5, "schedule-fraction")
    assert fraction["layers"] == made["layers"]
    gc = in_process("gc", run, *common[:2], "--n", 24, "--seq-len", 16, "--resamples", 0, "--null-draws", 0,
                    "--out", tmp_path / "gc")
    assert gc.returncode == 0, gc.stderr[-2000:]
    assert "|GC| peaks at step" in gc.stdout
    compare = in_process("compare", run, "--plan", tmp_path / "plan.json", "--train-data", trainer_run / "train.jsonl",
                         "--data", rows, "--label-column", "domain", "--steps", 2, "--batch-size", 4, "--seq-len", 16,
                         "--min-cluster-size", 5, "--out", tmp_path / "cmp")
    assert compare.returncode == 0, compare.stderr[-2000:]
    assert "every arm trains at batch 4 (given; the run used 8), on packed blocks of 16 tokens (given)" \
        in compare.stdout  # the run's batch: trainer_state.json's train_batch_size x accumulation
    assert "packed is the default (the run records no layout: a Trainer checkpoint keeps no collator" in compare.stdout
    rows_cmp = in_process("compare", run, "--plan", tmp_path / "plan.json", "--train-data", trainer_run / "train.jsonl",
                          "--data", rows, "--label-column", "domain", "--steps", 2, "--seq-len", 16, "--layout", "rows",
                          "--min-cluster-size", 5, "--out", tmp_path / "cmp-rows")
    assert rows_cmp.returncode == 0, rows_cmp.stderr[-2000:]
    assert "at batch 8 (the Trainer run's train_batch_size x gradient_accumulation_steps, per process), on padded " \
        "rows, one text each, of at most 16 tokens (given) of the training table's text; the layout is given" \
        in " ".join(rows_cmp.stdout.split())
    arm = json.loads((tmp_path / "cmp-rows" / "runs" / "cse-seed0" / "train_config.json").read_text())
    assert (arm["data"]["layout"], arm["batch_size"]) == ("rows", 8)
    warmup = made["convert_at"]
    start = json.loads((tmp_path / "cmp" / "compare.json").read_text())["init_from"]
    assert start.endswith(f"checkpoint-{max(s for s in (2, 4, 6) if s <= warmup)}")
