"""Your own ``Trainer``, CSE at the warm-up, and the result as a transformers model.

A GPT-NeoX (Pythia's architecture) trains with Hugging Face's ``Trainer`` on labelled text (the
corpus pack that ships with ntkscope stands in for your table: a ``text`` and a ``domain``
column). ``SparseCallback`` converts it to CSE at the warm-up step inside ``trainer.train()``
(from ``--plan``, a plan that ``ntkscope plan`` wrote, or ``--convert-at`` and ``--layers``). The
result is saved, read back with ``AutoModelForCausalLM.from_pretrained``, asked to
``generate``, and the expert report says what its experts learned of the domains::

    python examples/trainer_cse.py --out trainer-run        # 4 layers x 128, 600 steps, CSE at step 300

Writes ``OUT/checkpoint-N`` (Trainer's), ``OUT/cse`` (the converted model, transformers' format),
``OUT/experts.csv`` and ``OUT/findings.txt``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import transformers

import cse_models  # noqa: F401  (registers the sparse models with transformers' Auto classes)
from cse_models.expert_report import expert_report
from cse_models.hf_trainer import SparseCallback
from ntkscope.text.corpus.pack import load_pack

log = logging.getLogger("trainer_cse")


def blocks(tokenizer, rows, seq_len: int) -> torch.Tensor:
    """Each domain's texts, concatenated and cut into (N, seq_len) blocks."""
    out = []
    for domain in sorted({d for _, d in rows}):
        ids = [i for text, d in rows if d == domain for i in tokenizer.encode(text) + [tokenizer.eos_token_id]]
        n = len(ids) // seq_len
        out.append(torch.tensor(ids[:n * seq_len]).view(n, seq_len))
    return torch.cat(out)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--convert-at", type=int, default=300, help="the step to convert at (default: 300)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--plan", help="a plan.json from `ntkscope plan`: its warm-up and layers")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--test-per-domain", type=int, default=100)
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)

    pack = load_pack()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(pack.path / "tokenizer.json"),
                                                     eos_token="<|endoftext|>", pad_token="<pad>")
    train_rows = [(r.text, r.domain) for r in pack.records("train")]
    train = blocks(tokenizer, train_rows, args.seq_len)
    config = transformers.GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=args.width,
                                        intermediate_size=4 * args.width, num_hidden_layers=args.n_layer,
                                        num_attention_heads=4, max_position_embeddings=args.seq_len, rotary_pct=0.25)
    model = transformers.GPTNeoXForCausalLM(config)

    fitting = {"input_ids": train[torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:1000]]}
    plan = {"plan": args.plan} if args.plan else {"convert_at": args.convert_at, "layers": args.layers}
    callback = SparseCallback(**plan, kind="cse", fitting=fitting, router={"min_cluster_size": 15})
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=32, learning_rate=1e-3,
        lr_scheduler_type="cosine", warmup_steps=min(50, args.steps // 10), save_steps=max(args.steps // 4, 1),
        logging_steps=max(args.steps // 10, 1), report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    data = [{"input_ids": row, "labels": row} for row in train]
    transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=[callback]).train()

    callback.save(out / "cse")  # transformers' format: AutoModelForCausalLM reads it after `import cse_models`
    tokenizer.save_pretrained(out / "cse")
    cse = transformers.AutoModelForCausalLM.from_pretrained(out / "cse")
    prompt = tokenizer("The licence", return_tensors="pt")
    text = tokenizer.decode(cse.generate(**prompt, max_new_tokens=20, do_sample=False)[0])
    log.info("generated: %s", text)

    test = {}
    for r in pack.records("test"):
        test.setdefault(r.domain, []).append(r.text)
    texts = [(t, d) for d in sorted(test) for t in test[d][:args.test_per_domain]]
    report = expert_report(cse.sparse, [tokenizer.encode(t) for t, _ in texts], [d for _, d in texts], n_boot=200)
    report.experts.to_csv(out / "experts.csv", index=False)
    (out / "findings.txt").write_text("\n".join(report.findings) + "\n")
    for finding in report.findings:
        log.info("finding: %s", finding)
    return {"generated": text, "report": report, "converted_at": callback.convert_at}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
