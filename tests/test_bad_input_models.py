"""Bad input that reaches the models and their training: a bfloat16 HF model with a CSE layer
(routed in float32, kept in its own dtype elsewhere), table rows that lack their label (left out
with one warning, by every command), and ``data.text_files`` as a list or a mapping (anything
else refused in one line when the config is checked)."""

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
from commandline import one_line_error
import torch

from cse_models import GPT, GPTConfig
from cse_models.cse import convert_to_cse
from cse_models.domains import evaluate_domains
from cse_models.hf import load_hf
from cse_models.model import load_model
from cse_models.train import TrainConfig, load_data, main as cse_train, train
from ntkscope.app.cli import main as ntkscope
from ntkscope.text.corpus.pack import DEFAULT_PACK, load_pack
from ntkscope.text.inputs import DataSource

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")




@pytest.fixture(scope="module")
def texts():
    """Real sentences of the shipped pack: {domain: [text, ...]}, a few per domain."""
    records = list(load_pack().records("test"))
    return {d: [r.text for r in records if r.domain == d][:12] for d in ("legal", "biomedical")}


# ---- row 6: a bfloat16 HF model with a CSE layer -------------------------------------------


def _bf16_gpt2(directory: Path) -> Path:
    """A tiny GPT-2 saved in bfloat16 (config.json says so) with the pack's tokenizer beside it."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(directory)
    shutil.copy(DEFAULT_PACK / "tokenizer.json", directory / "tokenizer.json")
    return directory


def test_a_bf16_model_with_a_cse_layer_routes_as_its_float32_copy(tmp_path):
    model = load_hf(_bf16_gpt2(tmp_path / "bf16"), {"kind": "cse", "layers": [1], "n_experts": [0]})
    assert next(model.parameters()).dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(start, start + 20, (30, 12), generator=g) for start in (0, 4000, 7000)])
    convert_to_cse(model, ids, None, min_cluster_size=5, min_samples=2)  # sequences of three vocabularies
    layer = model.sparse_module(1)
    assert len(layer.experts) >= 2 and layer.centres.dtype == torch.bfloat16
    logits = model(ids[:8])  # routed in float32, computed in bfloat16
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    hidden = torch.randn(8, 12, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    mask = torch.ones(8, 12, dtype=torch.bool)
    mask[3, 5:] = False
    as_float = copy.deepcopy(layer).float()
    z, assign = layer.route(hidden, mask)
    z32, assign32 = as_float.route(hidden.float(), mask)
    assert z.dtype == torch.float32 and torch.equal(assign, assign32)
    torch.testing.assert_close(z, z32, rtol=0, atol=0)
    out = layer.train()(hidden, mask)  # training: the centres follow in their own dtype
    layer.update_centres()
    assert out.dtype == torch.bfloat16 and layer.centres.dtype == torch.bfloat16


def test_cse_train_from_a_bf16_init_from_finishes(tmp_path, texts):
    rows = [{"text": t, "domain": d} for d, ts in texts.items() for t in ts]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = train(TrainConfig.from_dict({
        "out_dir": str(tmp_path / "run"), "init_from": str(_bf16_gpt2(tmp_path / "bf16")),
        "model": {"sparse": {"kind": "cse", "layers": [1], "n_experts": [0]}},
        "cse": {"convert_at": 0, "n_samples": 40, "min_cluster_size": 5, "min_samples": 2},
        "data": {"table": str(tmp_path / "train.jsonl"), "label_column": "domain", "seq_len": 16},
        "steps": 2, "batch_size": 4, "warmup_steps": 1, "tensorboard": False, "device": "cpu"}))
    assert last.name == "step-000002"
    saved = json.loads((last / "config.json").read_text())
    assert saved["cse_sparse"]["sparse"]["n_experts"][0] >= 1


# ---- row 8: table rows without their label ---------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ckpt") / "gpt"
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(root)
    shutil.copy(DEFAULT_PACK / "tokenizer.json", root / "tokenizer.json")
    return root


def _unlabelled_rows(path: Path, texts, unlabelled=(2, 5)) -> Path:
    """A .jsonl whose rows ``unlabelled`` (1-based) lack the ``domain`` key (one has it null)."""
    rows = [{"text": t, "domain": d} for d, ts in texts.items() for t in ts[:4]]
    for n in unlabelled:
        rows[n - 1] = {"text": rows[n - 1]["text"]} if n % 2 == 0 else {"text": rows[n - 1]["text"], "domain": None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_without_a_label_are_left_out_with_one_warning(tmp_path, texts, caplog):
    data = _unlabelled_rows(tmp_path / "rows.jsonl", texts)
    with caplog.at_level(logging.WARNING):
        rows = DataSource(data, label_column="domain").rows()
    assert len(rows) == 6 and {label for _, label in rows} == {"legal", "biomedical"}
    warned = [r.getMessage() for r in caplog.records if "no label" in r.getMessage()]
    assert len(warned) == 1, warned
    assert str(data) in warned[0] and "'domain'" in warned[0] and "2 of 8 rows" in warned[0] and "row 2" in warned[0]


def test_eval_leaves_out_rows_without_a_label(checkpoint, tmp_path, texts, capsys):
    data = _unlabelled_rows(tmp_path / "rows.jsonl", texts)
    code = ntkscope(["-q", "eval", str(checkpoint), "--data", str(data), "--label-column", "domain",
                     "--n-boot", "10", "--out", str(tmp_path / "eval")])
    assert code == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "eval" / "result.json").read_text())
    assert result["texts"] == 6
    assert sorted(r["domain"] for r in result["perplexity"]) == ["biomedical", "legal"]


def test_a_label_column_with_no_label_is_one_line(checkpoint, tmp_path, texts, capsys):
    data = _unlabelled_rows(tmp_path / "rows.jsonl", texts, unlabelled=range(1, 9))
    err = one_line_error(capsys, ntkscope, "-q", "eval", checkpoint, "--data", data, "--label-column", "domain")
    assert str(data) in err and "'domain'" in err and "no label" in err, err


def test_evaluate_domains_refuses_a_missing_label_by_name(checkpoint):
    with pytest.raises(ValueError, match=r"^evaluate_domains: labels must be strings, one domain per text; text 2 has "
                                         r"none \(got nan\)$"):
        evaluate_domains(load_model(checkpoint), [[1, 2, 3], [4, 5, 6]], ["legal", float("nan")])


# ---- row 15: data.text_files -----------------------------------------------------------------


def _text_files_config(tmp_path, texts, text_files) -> Path:
    for domain, ts in texts.items():
        (tmp_path / f"{domain}.txt").write_text("\n\n".join(ts) + "\n")
    config = {"out_dir": str(tmp_path / "run"), "model": {"n_layer": 1, "n_head": 2, "n_embd": 16},
              "data": {"text_files": text_files, "tokenizer": str(DEFAULT_PACK / "tokenizer.json"), "seq_len": 16},
              "steps": 2, "batch_size": 4, "warmup_steps": 1, "tensorboard": False, "device": "cpu"}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("shape", ["list", "mapping"])
def test_cse_train_reads_text_files_as_a_list_or_a_mapping(tmp_path, texts, capsys, shape):
    files = {d: [str(tmp_path / f"{d}.txt")] for d in texts}
    text_files = [p for paths in files.values() for p in paths] if shape == "list" else files
    config = _text_files_config(tmp_path, texts, text_files)
    assert cse_train([str(config)]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
    blocks, _ = load_data(TrainConfig.load(config))  # a list is one domain, "text"; a mapping names them
    assert blocks.domain_names == (("text",) if shape == "list" else ("biomedical", "legal"))


@pytest.mark.parametrize("value", [3, "legal.txt", [], {"legal": 3}, [1, 2], {"legal": []}])
def test_a_bad_text_files_value_is_one_line(tmp_path, texts, capsys, value):
    config = _text_files_config(tmp_path, texts, value)
    err = one_line_error(capsys, cse_train, config)
    assert "data.text_files must be" in err and f"(got {value!r})" in err, err
    assert not (tmp_path / "run").exists()


def test_a_missing_text_file_is_one_line(tmp_path, texts, capsys):
    config = _text_files_config(tmp_path, texts, [str(tmp_path / "nowhere.txt")])
    err = one_line_error(capsys, cse_train, config)
    assert "nowhere.txt" in err, err


def test_conversion_refuses_a_model_that_is_not_a_sparse_host():
    from cse_models.cse import upcycle

    for convert in (lambda m: convert_to_cse(m, torch.zeros(2, 4, dtype=torch.long)), upcycle):
        with pytest.raises(ValueError, match=r"must be a cse_models.SparseHost .* Linear has no config, sparse_module"):
            convert(torch.nn.Linear(2, 2))
