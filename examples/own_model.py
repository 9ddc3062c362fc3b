"""Your model, your data: the starting point of the README's walkthrough, with no hub.

Writes ``OUT/data/train.jsonl`` and ``OUT/data/test.jsonl`` (real text from the corpus pack that
ships with ntkscope, a ``text`` and a ``domain`` column: stand-ins for your own files), builds a
GPT-NeoX (Pythia's architecture) from a config, and trains it with a plain PyTorch loop, saving
Pythia-style checkpoints ``OUT/stepN`` (``config.json`` + ``model.safetensors``) every
``--save-every`` steps and the tokenizer beside them (``OUT/tokenizer.json``)::

    python examples/own_model.py --out myrun            # 4 layers x 128, 600 steps
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch
import transformers

from ntkscope.text.corpus.pack import DEFAULT_PACK, load_pack
from ntkscope.text.tokenization import load_tokenizer

log = logging.getLogger("own_model")


def write_data(out: Path, per_domain_test: int, train_rows: int | None) -> None:
    pack = load_pack()
    for split, name in (("train", "train"), ("test", "test")):
        rows = [{"text": r.text, "domain": r.domain} for r in pack.records(split)]
        if split == "train" and train_rows is not None:
            rows = random.Random(0).sample(rows, min(train_rows, len(rows)))
        if split == "test":
            by_domain: dict = {}
            for r in rows:
                by_domain.setdefault(r["domain"], []).append(r)
            rows = [r for d in sorted(by_domain) for r in by_domain[d][:per_domain_test]]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="myrun")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--test-per-domain", type=int, default=200, help="test rows per domain")
    parser.add_argument("--train-rows", type=int, help="a random sample of the training rows (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    write_data(out / "data", args.test_per_domain, args.train_rows)
    (out / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    tok = load_tokenizer(out / "tokenizer.json")
    texts = [json.loads(line)["text"] for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    random.Random(args.seed).shuffle(texts)
    eot = tok.backend.token_to_id("<|endoftext|>") or 0
    stream = torch.tensor([t for ids in tok.encode(texts) for t in (*ids, eot)])
    blocks = stream[: len(stream) // args.seq_len * args.seq_len].view(-1, args.seq_len)
    torch.manual_seed(args.seed)
    config = transformers.GPTNeoXConfig(vocab_size=tok.vocab_size, hidden_size=args.width,
                                        intermediate_size=4 * args.width, num_hidden_layers=args.layers,
                                        num_attention_heads=4, max_position_embeddings=args.seq_len, rotary_pct=0.25,
                                        bos_token_id=eot, eos_token_id=eot)
    model = transformers.GPTNeoXForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.save_every == 0:
            model.save_pretrained(out / f"step{step}")  # safetensors + config.json
        if step == args.steps:
            break
        batch = blocks[torch.randint(0, len(blocks), (args.batch_size,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0:
            log.info("step %d loss %.3f (%.0f s)", step + 1, loss.item(), time.perf_counter() - start)
    log.info("wrote %s/step0 ... step%d, %s/tokenizer.json and %s/data/{train,test}.jsonl", out, args.steps, out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
