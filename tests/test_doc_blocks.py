"""Every code block of the README and the guide (docs/*.md) either runs here, as written, at toy
size, or is marked ``<!-- not run: why -->`` on the line before it. A runnable block gets the
names it expects (``model``, ``args``, ``tokenizer``, ...) from its setup below, small enough
for a test; the block's own text is executed unchanged."""

import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->$")


def doc_blocks():
    """(file, line, language, code, why not run or None) for every python and bash block."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = NOT_RUN.match(before)
            yield (path.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 1, m[1], m[2],
                   mark[1] if mark else None)


# ---- the setups: the names a block uses, at toy size --------------------------------------

def _tiny_gpt2(vocab: int = 50, positions: int = 32):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, bos_token_id=None, eos_token_id=None, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _trainer_names(max_steps: int) -> dict:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir="trainer-out", max_steps=max_steps, per_device_train_batch_size=8,
                                          learning_rate=3e-3, save_strategy="no", report_to=[], use_cpu=True,
                                          seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return {"Trainer": transformers.Trainer, "args": args}


def _sparse_trainer():
    """README's and own-model.md's Trainer conversion: a tiny GPT-2 on two planted domains, a plan."""
    g = torch.Generator().manual_seed(0)
    train_ids = torch.cat([torch.randint(0, 25, (48, 16), generator=g), torch.randint(25, 50, (48, 16), generator=g)])
    Path("plan.json").write_text(json.dumps({"convert_at": 4, "layers": [0, 1]}))
    return {**_trainer_names(8), "model": _tiny_gpt2(), "train_ids": train_ids,
            "data": [{"input_ids": r, "labels": r} for r in train_ids]}


def _tracker():
    """tracking.md's GCTracker in a Trainer: the shipped pack's sentences as the user's table."""
    from ntkscope.text.corpus.pack import load_pack

    pack = load_pack()
    tokenizer = pack.tokenizer()
    rows = [{"text": r.text, "label": r.domain} for r in pack.records("validation")]
    with open("my_table.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[::8] + [r for r in rows if r["label"] == "legal"][:48]
                     + [r for r in rows if r["label"] == "biomedical"][:48])
    ids = [torch.tensor(tokenizer.encode([r["text"]])[0][:16]) for r in rows[:64]]
    train = [{"input_ids": i, "labels": i} for i in ids if len(i) == 16]
    return {**_trainer_names(100), "tokenizer": tokenizer, "model": _tiny_gpt2(vocab=8192, positions=256),
            "train": train}


def _tracked_conversion():
    """own-model.md's tracker and conversion in one Trainer: a tiny GPT-2 on the shipped pack's
    sentences (the user's table), checkpoints every 4 steps, a plan converting at step 4."""
    names = _tracker()
    transformers = pytest.importorskip("transformers")
    names["args"] = transformers.TrainingArguments(
        output_dir="out", max_steps=8, per_device_train_batch_size=8, learning_rate=3e-3, save_steps=4, report_to=[],
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    names["data"] = names.pop("train")
    names["train_ids"] = torch.stack([row["input_ids"] for row in names["data"]])
    Path("plan.json").write_text(json.dumps({"convert_at": 4, "layers": [0, 1]}))
    return names


def _tracked_and_converted(names):
    frame = names["tracker"].frame
    assert sorted(set(frame["step"])) == [4, 8] and frame["gc"].notna().all()
    assert type(names["at_step_8"]).__name__ == "SparseForCausalLM"


def _inrun():
    """tracking.md's InRunGC loop: a tiny GPT-2, batches with one domain label per sample."""
    model = _tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    loader = []
    for _ in range(2):
        ids = torch.randint(0, 50, (6, 12), generator=g)
        labels = ids.clone()
        labels[0, 8:] = -100
        loader.append(({"input_ids": ids, "labels": labels}, ["legal", "general"] * 3))
    return {"model": model, "loader": loader, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def _converted(names):
    assert names["callback"].sparse is not None and Path("cse-model", "config.json").is_file()


def _tracked(names):
    import pandas as pd

    rows = pd.read_csv("run/track/gc.csv")
    assert set(rows["step"]) == {100} and set(rows["label"]) >= {"legal", "biomedical"}


def _own_experiment():
    """own-model.md's spec over the researcher's model and table: its TOML block as own.toml, a
    tiny GPT-NeoX with a BPE of its own as my-model, the shipped pack's prose and legal text as
    rows.jsonl."""
    transformers = pytest.importorskip("transformers")
    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.tokenization import train_bpe

    text = (ROOT / "docs" / "own-model.md").read_text()
    Path("own.toml").write_text(re.search(r"^```toml\n(.*?)^```", text, re.S | re.M)[1])
    records = load_pack().records("train")
    rows = [{"text": r.text, "domain": "prose"} for r in records if r.domain == "general"][:400]
    rows += [{"text": r.text, "domain": "licence"} for r in records if r.domain == "legal"][:120]
    Path("rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_bpe([r["text"] for r in rows], vocab_size=600)
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, max_position_embeddings=128, rotary_pct=0.25, bos_token_id=0,
        eos_token_id=0)).save_pretrained("my-model")
    Path("my-model", "tokenizer.json").write_text(tokenizer.backend.to_str())
    return {}


def _own_experiment_ran(names):
    import pandas as pd

    assert not names["outcome"].failed
    arms = pd.read_csv("own-run/tables/arms.csv")
    assert set(arms["arm"]) == {"dense", "cse"} and {"ppl licence", "ppl prose"} <= set(arms.columns)


#: (file, the block's first line) -> (its setup, a check of what it made)
RUNS = {
    ("README.md", "import cse_models                                   # transformers' Auto classes now read sparse "
                  "checkpoints"): (_sparse_trainer, _converted),
    ("docs/own-model.md", "from cse_models.hf_trainer import SparseCallback"): (_sparse_trainer, _converted),
    ("docs/own-model.md", "import cse_models                                    # the Auto classes read the "
                          "sparse checkpoints"): (_tracked_conversion, _tracked_and_converted),
    ("docs/own-model.md", "from ntkscope.experiments import load_spec, run_experiment"):
        (_own_experiment, _own_experiment_ran),
    ("docs/corpora.md", "from ntkscope.text.corpus import load_pack"): (dict, lambda n: len(n["sizes"]) > 0),
    ("docs/cse-models.md", "import transformers"): (dict, lambda n: n["dense_ffn"].mlp is n["hf"].transformer.h[1].mlp),
    ("docs/engine.md", "import ntkscope as ns"): (dict, lambda n: "general" in set(n["by_domain"]["label"])),
    ("docs/tracking.md", "from ntkscope import GCTracker, GCCallback, Probes"): (_tracker, _tracked),
    ("docs/tracking.md", "from ntkscope import InRunGC"): (_inrun, lambda n: len(n["rows"]) == 2),
}


def _key(block) -> tuple:
    return block[0], block[3].split("\n", 1)[0]


def test_every_block_runs_here_or_says_why_not():
    blocks = list(doc_blocks())
    unmarked = {_key(b): b for b in blocks if b[4] is None}
    assert len(unmarked) == sum(b[4] is None for b in blocks), "two runnable blocks of a file share a first line"
    missing = [f"{b[0]}:{b[1]}" for k, b in unmarked.items() if k not in RUNS]
    assert not missing, f"blocks neither run by this test nor marked '<!-- not run: why -->': {missing}"
    assert set(RUNS) <= set(unmarked), f"setups for blocks that are gone or marked: {set(RUNS) - set(unmarked)}"
    assert all(len(b[4]) > 10 for b in blocks if b[4] is not None)  # a reason, not a bare mark
    assert len(blocks) >= 20


@pytest.mark.parametrize("where", sorted(RUNS), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_the_block_runs_as_written(where, tmp_path, monkeypatch):
    block = next(b for b in doc_blocks() if _key(b) == where and b[4] is None)
    monkeypatch.chdir(tmp_path)
    torch.set_default_dtype(torch.float32)
    setup, check = RUNS[where]
    names = setup()
    exec(compile(block[3], f"{block[0]}:{block[1]}", "exec"), names)  # noqa: S102 - the documented code, as written
    assert check(names) is not False