"""Loading checks what loaded: HF weights that do not match their
config are refused in one line naming them, not filled with random values; a config's custom code
(``auto_map``) never runs, not even when stdin says yes; a tied GPT-2 state dict saved the HF way
(no ``lm_head.weight``) loads with its head tied."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ntkscope.runs.checkpoints import load_checkpoint

transformers = pytest.importorskip("transformers")


def gpt2(tmp_path, name="m", n_layer=2):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                                                 n_layer=n_layer, n_head=2)).eval()
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


def set_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("n_layer", [1, 3])
def test_a_config_that_does_not_match_the_weights_is_refused(tmp_path, n_layer):
    _, path = gpt2(tmp_path)
    set_config(path, n_layer=n_layer)
    what = "unexpected" if n_layer == 1 else "missing"
    with pytest.raises(ValueError, match=rf"do not match its config.json: .*{what} \d+ \(transformer.h.\d"):
        load_checkpoint(path)


def test_weights_under_other_names_are_refused(tmp_path):
    _, path = gpt2(tmp_path)
    state = load_file(path / "model.safetensors")
    save_file({f"backbone.{k}": v for k, v in state.items()}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \d+ .*unexpected \d+ \(backbone\."):
        load_checkpoint(path)


def test_custom_code_never_runs_even_when_stdin_says_yes(tmp_path):
    model, path = gpt2(tmp_path)
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')\nfrom transformers import GPT2Config as Evil\n"
    (path / "evil.py").write_text(code)
    set_config(path, auto_map={"AutoConfig": "evil.Evil", "AutoModelForCausalLM": "evil.Evil"})
    script = f"from ntkscope.runs.checkpoints import load_checkpoint; load_checkpoint({str(path)!r}); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", script], input="yes\n" * 5, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loaded" in proc.stdout and not marker.exists()
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert "never run" in proc.stderr  # said in one warning line


def test_a_tied_gpt2_state_dict_saved_the_hf_way_loads_tied(tmp_path):
    model, path = gpt2(tmp_path)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    loaded = load_checkpoint(path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_work_end_to_end(tmp_path, dtype, caplog):
    """A bf16/fp16 checkpoint is computed in float32 on a copy, and says so;
    the command line finishes too."""
    import ntkscope as ns
    from commandline import in_process
    from ntkscope.text.corpus.pack import DEFAULT_PACK

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=16,
                                                                 n_layer=1, n_head=2)).eval()
    model.to(dtype).save_pretrained(tmp_path / "half")
    (tmp_path / "half" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    half = load_checkpoint(tmp_path / "half")
    assert next(half.parameters()).dtype == dtype
    batch = {"input_ids": torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(0))}
    with caplog.at_level("WARNING"):
        res = ns.empirical_ntk(half, batch)
        gc = ns.gradient_consistency(half, batch, [0, 1, 2], resampling=None)
    assert res.matrix.dtype == torch.float32 and torch.isfinite(res.matrix).all() and -1 <= gc.score <= 1
    assert "computing in float32 on a copy" in caplog.text
    assert next(half.parameters()).dtype == dtype  # the user's model is left as it was
    torch.testing.assert_close(res.matrix, ns.empirical_ntk(half.float(), batch).matrix)
    for command in (["ntk", "--n", 8], ["gc", "--n", 24, "--bins", 2, "--resamples", 20, "--null-draws", 20]):
        proc = in_process(command[0], tmp_path / "half", *command[1:], "--seq-len", 16, "--out",
                          tmp_path / f"out-{command[0]}")
        assert proc.returncode == 0, proc.stderr[-800:]


@pytest.mark.parametrize("value", [-1, "big", 2.5])
def test_an_hf_config_with_impossible_sizes_is_one_line(tmp_path, value):
    """Negative, text or fractional sizes gave tracebacks."""
    _, path = gpt2(tmp_path)
    set_config(path, n_embd=value)
    with pytest.raises(ValueError, match=r"config.json is not a valid HF config \("):
        load_checkpoint(path)


def test_a_seq_len_beyond_the_models_context_is_one_line(tmp_path):
    """--seq-len above an HF model's n_positions was an IndexError."""
    from commandline import in_process
    from ntkscope.text.corpus.pack import DEFAULT_PACK

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=16, n_layer=1,
                                                         n_head=2)).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    for command in ("ntk", "gc"):
        proc = in_process(command, tmp_path / "m", "--n", 8, "--seq-len", 64)
        assert proc.returncode == 1
        assert proc.stderr.strip() == f"ntkscope {command}: error: seq-len must be at most the model's context of " \
                                      "32 tokens (sentences of 35 tokens were read) (got 64)"
