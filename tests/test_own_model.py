"""A researcher's own HF model and data, end to end at toy size: a GPT-NeoX made from a config,
real text in a JSONL with a domain column, CSE conversion and training with ``cse-train``
(``init_from`` the HF directory), exact resume, and ``ntkscope eval`` whose per-domain
perplexities equal a direct computation with ``transformers`` on the same sequences."""

import html
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from cse_models import SparseHF, load_any_model
from cse_models.cse import convert_to_cse
from cse_models.domains import evaluate_domains
from cse_models.train import TrainConfig, train
from commandline import in_process, write_domain_rows
from ntkscope.core.files import load_safetensors
from ntkscope.runs.checkpoints import load_checkpoint
from ntkscope.runs.families import family_of
from ntkscope.text.corpus.pack import DEFAULT_PACK

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A dense GPT-NeoX directory (safetensors + config + tokenizer.json) and JSONL files of real text."""
    root = tmp_path_factory.mktemp("own")
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=2, max_position_embeddings=64, rotary_pct=0.25,
                                        bos_token_id=0, eos_token_id=0)
    with torch.device("cpu"):
        model = transformers.GPTNeoXForCausalLM(config).float()
    model.save_pretrained(root / "model")
    (root / "model" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    write_domain_rows(root, {"train": 120, "test": 20})
    return root


def config(own, out, **kw):
    return TrainConfig.from_dict({
        "out_dir": str(out), "init_from": str(own / "model"),
        "model": {"sparse": {"kind": "cse", "layers": [1, 2], "n_experts": [0, 0]}},
        "cse": {"convert_at": 0, "n_samples": 200, "min_cluster_size": 10},
        "data": {"table": str(own / "train.jsonl"), "label_column": "domain", "seq_len": 32},
        "steps": 6, "batch_size": 8, "checkpoint_every": 3, "warmup_steps": 2, "tensorboard": False,
        "device": "cpu", **kw})


def test_cse_train_converts_and_trains_an_hf_model_and_resumes_exactly(own, tmp_path):
    torch.set_default_dtype(torch.float32)
    last = train(config(own, tmp_path / "whole"))
    model = load_checkpoint(last)
    assert isinstance(model, SparseHF) and family_of(model).name == "gpt_neox+sparse"
    assert len(model.sparse_layers()) == 2
    saved = json.loads((last / "config.json").read_text())
    assert saved["model_type"] == "cse_models_sparse" and saved["base_model_type"] == "gpt_neox"
    assert saved["cse_sparse"]["sparse"]["router_format"] == 2
    metrics = pd.read_csv(tmp_path / "whole" / "metrics.csv")
    assert np.isfinite(metrics["loss"]).all() and metrics["step"].max() == 6
    # killed after step 3 and resumed: the same weights as the uninterrupted run
    train(config(own, tmp_path / "split", stop_at=3))
    resumed = train(config(own, tmp_path / "split"))
    a, b = load_safetensors(last / "model.safetensors", "test"), load_safetensors(resumed / "model.safetensors", "test")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def direct_perplexity(model, texts, labels, tokenizer):
    """One text at a time, no padding: exp(mean NLL) per domain."""
    nll, pairs = {}, {}
    for text, label in zip(texts, labels):
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False).ids[:64]])
        if ids.shape[1] < 2:
            continue
        with torch.no_grad():
            logits = model(ids) if isinstance(model, SparseHF) else model(input_ids=ids).logits
        loss = F.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="sum")
        nll[label] = nll.get(label, 0.0) + float(loss)
        pairs[label] = pairs.get(label, 0) + ids.shape[1] - 1
    return {d: float(np.exp(nll[d] / pairs[d])) for d in nll}


def test_eval_equals_a_direct_computation_for_dense_and_converted_models(own, tmp_path):
    torch.set_default_dtype(torch.float32)
    rows = [json.loads(line) for line in (own / "test.jsonl").read_text().splitlines()]
    texts, labels = [r["text"] for r in rows], [r["domain"] for r in rows]
    tok = tokenizers.Tokenizer.from_file(str(own / "model" / "tokenizer.json"))
    dense = transformers.AutoModelForCausalLM.from_pretrained(own / "model").eval()
    # the converted model: CSE at layers 1-2, fitted on the training rows (planted apart by domain below)
    cse = load_any_model(own / "model", dict(kind="cse", layers=[1, 2], n_experts=[0, 0]))
    train_rows = [json.loads(line) for line in (own / "train.jsonl").read_text().splitlines()]
    fit_ids = torch.zeros(len(train_rows), 32, dtype=torch.long)
    fit_mask = torch.zeros_like(fit_ids)
    for i, r in enumerate(train_rows):
        ids = tok.encode(r["text"], add_special_tokens=False).ids[:32]
        fit_ids[i, :len(ids)], fit_mask[i, :len(ids)] = torch.tensor(ids), 1
    convert_to_cse(cse, fit_ids, fit_mask, min_cluster_size=10, max_experts=4)
    cse.save_pretrained(tmp_path / "cse")
    (tmp_path / "cse" / "tokenizer.json").write_bytes((own / "model" / "tokenizer.json").read_bytes())
    for name, model, directory in (("dense", dense, own / "model"), ("cse", cse, tmp_path / "cse")):
        out = tmp_path / f"eval-{name}"
        proc = in_process("eval", directory, "--data", own / "test.jsonl", "--label-column", "domain", "--out", out,
                          "--n-boot", 200)
        assert proc.returncode == 0, proc.stderr
        table = pd.read_csv(out / "perplexity.csv").set_index("domain")
        expected = direct_perplexity(model, texts, labels, tok)
        assert sorted(table.index) == sorted(expected) == ["biomedical", "general", "legal"]
        for d, ppl in expected.items():
            assert table.loc[d, "ppl"] == pytest.approx(ppl, rel=1e-5)
            assert table.loc[d, "ppl_low"] < table.loc[d, "ppl"] < table.loc[d, "ppl_high"]
            assert table.loc[d, "texts"] == 20
        result = json.loads((out / "result.json").read_text())
        assert result["context"] == 64 and result["label_column"] == "domain"
        if name == "cse":  # the routing table: every domain's sequences, once per layer
            routing = pd.read_csv(out / "routing.csv")
            assert set(routing["layer"]) == {f"hf.gpt_neox.layers.{i}.mlp.layer" for i in (1, 2)}
            assert (routing.groupby(["layer", "domain"])["count"].sum() == 20).all()
            assert np.allclose(routing.groupby(["layer", "domain"])["share_of_domain"].sum(), 1.0)
            assert (out / "routing.png").is_file()
        else:
            assert not (out / "routing.csv").exists()


def test_routing_is_computed_in_eval_mode_and_leaves_the_mode(own):
    model = load_any_model(own / "model", dict(kind="switch", layers=[1], n_experts=[0]))
    from cse_models.cse import upcycle
    upcycle(model, 2)
    model.train()
    result = evaluate_domains(model, [[1, 2, 3, 4], [5, 6, 7], [8]], ["a", "b", "b"], n_boot=10)
    assert model.training  # left as it was
    assert list(model.sparse_layers().values())[0].load.sum() == 0  # eval mode: no bookkeeping
    routing = result.routing
    assert set(routing["unit"]) == {"tokens"} and routing["count"].sum() == 4 + 3  # a one-token text is not run
    assert result.perplexity.set_index("domain").loc["b", "tokens"] == 2  # the one-token text has no pair


def test_the_walkthrough_from_a_config_to_a_comparison(tmp_path, caplog):
    """The README's "your model, your data", at toy size: train a GPT-NeoX from a config with a plain
    loop (stepN checkpoints), plan on its checkpoints with the domain labels, compare dense / CSE /
    Switch from the plan's warm-up, evaluate; a plan measured on another architecture is refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("own_model", Path(__file__).parents[1] / "examples" / "own_model.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.set_default_dtype(torch.float32)
    run, data = tmp_path / "myrun", tmp_path / "myrun" / "data"
    assert example.main(["--out", str(run), "--layers", "3", "--width", "32", "--steps", "20", "--save-every", "10",
                         "--seq-len", "32", "--test-per-domain", "12", "--train-rows", "600"]) == 0
    proc = in_process("plan", run, "--data", data / "train.jsonl", "--label-column", "domain", "--n", 48,
                      "--seq-len", 32, "--out", run / "plan.json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((run / "plan.json").read_text())
    assert plan["source"]["model_type"] == "gpt_neox" and plan["source"]["n_layer"] == 3
    assert plan["source"]["steps"] == [0, 10, 20] and plan["source"]["label_column"] == "domain"
    proc = in_process("compare", run, "--plan", run / "plan.json", "--train-data", data / "train.jsonl", "--data",
                      data / "test.jsonl", "--label-column", "domain", "--steps", 4, "--batch-size", 4,
                      "--seq-len", 32, "--min-cluster-size", 5, "--out", tmp_path / "cmp")
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(tmp_path / "cmp" / "tables" / "comparison.csv")
    assert sorted(set(table["arm"])) == ["cse", "demix", "dense", "switch"] and len(table) == 12
    assert (table.loc[table["arm"] == "dense", "vs_dense"] == 0).all()
    cse = table.loc[table["arm"] == "cse", "checkpoint"].iloc[0]
    proc = in_process("eval", cse, "--data", data / "test.jsonl", "--label-column", "domain", "--out",
                      tmp_path / "eval")
    assert proc.returncode == 0, proc.stderr
    merged = pd.read_csv(tmp_path / "eval" / "perplexity.csv").merge(table[table["arm"] == "cse"], on="domain")
    np.testing.assert_allclose(merged["ppl_x"], merged["ppl_y"], rtol=1e-9)  # eval = the comparison's cse row
    assert (tmp_path / "eval" / "routing.png").is_file()
    # what the experts learned: findings first, per layer and expert, each expert ablated
    assert "what the experts learned:" in proc.stdout
    assert proc.stdout.index("what the experts learned:") < proc.stdout.index("perplexity per domain")
    layers = pd.read_csv(tmp_path / "eval" / "expert_layers.csv")
    assert layers["layer"].str.match(r"layer \d+ \(mlp\)").all() and layers["purity"].between(0, 1).all()
    ablation = pd.read_csv(tmp_path / "eval" / "ablation.csv")
    assert set(ablation["domain"]) == set(merged["domain"]) and (ablation["change_low"] <= ablation["change_high"]).all()
    findings = json.loads((tmp_path / "eval" / "result.json").read_text())["findings"]
    assert findings and all(f.startswith("layer ") for f in findings)
    # ... and in `ntkscope report` of that result: the findings first, the tables, every column described
    proc = in_process("report", tmp_path / "eval", "--out", tmp_path / "eval.html")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "eval.html").read_text()
    assert ">What the experts learned</h2>" in page and page.index(">What was found</h2>") < page.index(
        ">What the experts learned</h2>")
    assert html.escape(findings[0]) in page and "one expert ablated" in page and "not described" not in page
    # the same plan on a 2-layer model: refused in one line naming the mismatch
    other = tmp_path / "other"
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, rotary_pct=0.25)).save_pretrained(other)
    (other / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    proc = in_process("compare", other, "--plan", run / "plan.json", "--train-data", data / "train.jsonl", "--data",
                      data / "test.jsonl", "--label-column", "domain", "--steps", 2, "--batch-size", 4,
                      "--seq-len", 32, "--out", tmp_path / "cmp-other")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert "3-layer gpt_neox model and this one has 2 layers" in proc.stderr


def test_cse_eval_takes_the_same_flags(own, tmp_path):
    from cse_models.evaluate import main as cse_eval

    out = tmp_path / "cse-eval"
    assert cse_eval([f"dense={own / 'model'}", "--data", str(own / "test.jsonl"), "--label-column", "domain",
                     "--out", str(out)]) == 0
    ours = in_process("eval", own / "model", "--data", own / "test.jsonl", "--label-column", "domain", "--out",
                      tmp_path / "ntkscope-eval")
    assert ours.returncode == 0, ours.stderr
    a = pd.read_csv(out / "perplexity.csv").drop(columns="name")
    b = pd.read_csv(tmp_path / "ntkscope-eval" / "perplexity.csv")
    pd.testing.assert_frame_equal(a, b)


def test_the_plans_warmup_is_shifted_by_the_init_from_step(caplog):
    from cse_models.train_config import warmup_after

    assert warmup_after("myrun/step200", 300, "plan.json") == 100
    assert warmup_after("run/checkpoints/step-000300", 300, "plan.json") == 0
    assert warmup_after("somewhere/model", 300, "plan.json") == 300  # no step in the name: a fresh start
    with caplog.at_level("WARNING"):
        assert warmup_after("myrun/step500", 300, "plan.json") == 0
    assert "init_from myrun/step500 is step 500: converting at once" in caplog.text


FAMILY_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=32, n_layer=2, n_head=2),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=8192, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=2,
                                                   max_position_embeddings=32, rotary_pct=0.25, bos_token_id=0,
                                                   eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=32, tie_word_embeddings=False),
    # encoders (Table 1's CSE-BERT on the researcher's own model): trained on masked tokens
    "bert": lambda: transformers.BertConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, max_position_embeddings=32),
    "roberta": lambda: transformers.RobertaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  max_position_embeddings=36, pad_token_id=1),
}
MASKED = ("bert", "roberta")


@pytest.mark.parametrize("kind, sparse", [(k, s) for k in sorted(FAMILY_CONFIGS) for s in ("cse", "switch")]
                         + [("llama", "cse-attn"), ("bert", "cse-attn")])
def test_every_family_converts_trains_and_resumes_exactly(own, tmp_path, kind, sparse):
    """Per family: cse-train from the HF directory converts at step 0 (CSE on the FFN or, "cse-attn",
    on the attention: MoA), and a run killed after step 2 and resumed ends with the uninterrupted
    run's weights, bit for bit."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if kind in MASKED else transformers.AutoModelForCausalLM
    auto.from_config(FAMILY_CONFIGS[kind]()).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_bytes((own / "model" / "tokenizer.json").read_bytes())
    spec = {"kind": sparse.split("-")[0], "module": "attn" if sparse.endswith("attn") else "ffn", "layers": [1],
            "n_experts": [0]}
    extra = {"cse": {"convert_at": 0, "n_samples": 100, "min_cluster_size": 10}} if sparse != "switch" else \
        {"cse": {}, "upcycle": {"convert_at": 0, "n_experts": 2}}

    def run(out, **kw):
        return train(TrainConfig.from_dict({
            "out_dir": str(out), "init_from": str(tmp_path / "model"), "model": {"sparse": spec}, **extra,
            "data": {"table": str(own / "train.jsonl"), "label_column": "domain", "seq_len": 32},
            "steps": 4, "batch_size": 4, "checkpoint_every": 2, "warmup_steps": 1, "tensorboard": False,
            "device": "cpu", **kw}))

    whole = run(tmp_path / "whole")
    run(tmp_path / "split", stop_at=2)
    resumed = run(tmp_path / "split")
    model = load_checkpoint(whole)
    assert family_of(model).name == f"{'bert' if kind in MASKED else kind}+sparse" and len(model.sparse_layers()) == 1
    assert model.config.masked == (kind in MASKED)
    assert model.config.mask_token_id == (2 if kind in MASKED else None)  # the pack tokenizer's <mask>
    a, b = load_safetensors(whole / "model.safetensors", "test"), load_safetensors(resumed / "model.safetensors", "test")
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compare_continues_the_runs_schedule_and_optimizer_state(own, tmp_path):
    """From a cse-train checkpoint at step 3 of a 6-step run, compare's dense arm is that run
    continued (its AdamW state and schedule): on the same data and batches it ends with the
    uninterrupted run's step-6 weights, bit for bit; the CSE arm starts from the same state; a
    comparison longer than the run's schedule is refused in one line; --lr starts afresh."""
    from ntkscope.app.compare import compare_command

    torch.set_default_dtype(torch.float32)
    parent = tmp_path / "run"
    train(TrainConfig.from_dict({
        "out_dir": str(parent), "init_from": str(own / "model"),
        "data": {"table": str(own / "train.jsonl"), "label_column": "domain", "seq_len": 32},
        "steps": 6, "batch_size": 8, "checkpoint_every": 3, "warmup_steps": 2, "lr": 2e-3, "tensorboard": False,
        "device": "cpu"}))
    start = parent / "checkpoints" / "step-000003"
    kw = dict(layers=[1], label_column="domain", n_samples=200, min_cluster_size=10, n_boot=50)
    r = compare_command(start, own / "train.jsonl", own / "test.jsonl", steps=3, out=tmp_path / "cmp", **kw)
    assert "continues the cse-train run from step 3" in r["start"]  # at the run's own batch and blocks
    assert "every arm trains at batch 8 (the run's train_config), on packed blocks of 32 tokens" in r["start"]
    dense_end = tmp_path / "cmp" / "runs" / "dense-seed0" / "checkpoints" / "step-000006"
    a = load_safetensors(dense_end / "model.safetensors", "test")
    b = load_safetensors(parent / "checkpoints" / "step-000006" / "model.safetensors", "test")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cse_start = load_safetensors(tmp_path / "cmp" / "runs" / "cse-seed0" / "checkpoints" / "step-000003" /
                                 "optimizer.safetensors", "test")
    assert cse_start.keys() == load_safetensors(start / "optimizer.safetensors", "test").keys()
    with pytest.raises(ValueError, match=r"steps must end within the run's schedule.*at most 3"):
        compare_command(start, own / "train.jsonl", own / "test.jsonl", steps=4, out=tmp_path / "cmp2", **kw)
    assert not (tmp_path / "cmp2").exists()
    fresh = compare_command(start, own / "train.jsonl", own / "test.jsonl", steps=2, lr=1e-3, out=tmp_path / "cmp3",
                            **kw)
    assert "lr 0.001 given: every arm starts a fresh warm-up" in fresh["start"]
    assert (tmp_path / "cmp3" / "runs" / "dense-seed0" / "checkpoints" / "step-000002").is_dir()


def test_the_plain_conversion_in_a_hand_loop_equals_cse_trains(own, tmp_path):
    """convert_in_training in a hand-written loop, on cse-train's data, batch order, loss, optimizer
    and schedule, converting at the same step: the same weights as cse-train's run, to float
    tolerance (the one difference: cse-train builds a new optimizer at the conversion, the plain
    function moves the same one onto the experts)."""
    from cse_models.data import global_batch
    from cse_models.hf_trainer import convert_in_training
    from cse_models.train import fitting_sample, load_data, lr_factor, make_optimizer

    torch.set_default_dtype(torch.float32)
    cfg = config(own, tmp_path / "cse-train", steps=4, checkpoint_every=4, warmup_steps=1,
                 model={"sparse": {"kind": "cse", "layers": [1], "n_experts": [0]}},
                 cse={"convert_at": 2, "n_samples": 200, "min_cluster_size": 10})
    reference = load_safetensors(train(cfg) / "model.safetensors", "test")
    blocks, _ = load_data(cfg)
    model = load_any_model(own / "model").train()
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    for step in range(cfg.steps):
        if step == cfg.cse.convert_at:
            fitting = blocks.input_ids[fitting_sample(len(blocks), cfg.cse.n_samples, cfg.seed)]
            model = convert_in_training(model.hf, opt, {"kind": "cse", "layers": [1]}, fitting_ids=fitting,
                                        seed=cfg.seed, router=cfg.cse.router_options())
        ids = blocks.input_ids[global_batch(blocks, step, cfg.batch_size, cfg.seed)]
        loss = model(ids, None, None, positions=slice(None, -1), targets=ids[:, 1:]) / ids[:, 1:].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        model.update_routers()
    ours = model.state_dict()
    assert reference.keys() == ours.keys() and any(".experts.1." in k for k in ours)
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5, msg=key)
