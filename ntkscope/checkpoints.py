"""Checkpoints behind one function: a training run's directory (``cse_models``' layout,
``RUN/checkpoints/step-NNNNNN``), a ``cse_models`` checkpoint, an HF model directory, or
a plain state dict (``*.bin`` / ``*.pt``) beside a ``config.json``.

Safe by default: weights come from safetensors, or from ``torch.load(weights_only=True)``,
which refuses any pickle that would import or call code; such a file is reported, never
executed. The tokenizer comes with the checkpoint (``tokenizer.json``; for a
``cse_models`` run, the corpus pack named in its ``train_config.json``) or is named.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import warnings
from pathlib import Path

from ntkscope._checks import fail

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")
STATE_DICT_NAMES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / "checkpoints").is_dir()


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """[(step, path)] of a run's complete checkpoints, in step order."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP.match(p.name)
            if m and (p / "config.json").is_file() and (p / "model.safetensors").is_file():
                found.append((int(m.group(1)), p))
    if not found:
        raise FileNotFoundError(f"list_checkpoints: run_dir {run_dir} has no checkpoints "
                                "(expected checkpoints/step-NNNNNN directories with config.json and model.safetensors)")
    return sorted(found)


def load_state_dict(path: str | Path) -> dict:
    """A state dict from safetensors, or from a pickle through ``torch.load(weights_only=True)``.

    A pickle that would import or run code is refused with a clear error, never executed."""
    import torch

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        with warnings.catch_warnings():  # torch warns about the refused global; the error below says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        first = f"it imports {found.group(1)}" if found else (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"load_checkpoint: {path} is a pickle that would run code, refused, never executed "
                         f"({first[:160]}); save the weights as safetensors") from None
    except (EOFError, RuntimeError) as err:
        raise ValueError(f"load_checkpoint: {path} is not a readable PyTorch state dict ({str(err)[:160]})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"load_checkpoint: {path} does not hold a state dict of tensors")
    return state


def _weights_file(path: Path) -> Path | None:
    for name in ("model.safetensors", *STATE_DICT_NAMES):
        if (path / name).is_file():
            return path / name
    return None


def load_checkpoint(path: str | Path):
    """The model of a checkpoint directory, in eval mode.

    ``cse_models`` GPT/BERT (``config.json`` with ``model_type`` gpt/bert), or an HF model
    (``transformers``: GPT-2-style causal LMs, BERT-style MLMs and encoders), with weights
    from ``model.safetensors`` or a plain state dict (``pytorch_model.bin``, ``model.pt``).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"load_checkpoint: {path} does not exist")
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        hint = " (a training run: use its checkpoints/step-NNNNNN)" if is_run_dir(path) else ""
        raise FileNotFoundError(f"load_checkpoint: {path} is not a checkpoint directory: it has no config.json{hint}")
    weights = _weights_file(path)
    if weights is None:
        raise FileNotFoundError(f"load_checkpoint: {path} has no weights (model.safetensors or one of "
                                f"{list(STATE_DICT_NAMES)})")
    try:
        data = json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"load_checkpoint: {config} is not valid JSON ({err})") from None
    kind = data.get("model_type")
    if kind in ("gpt", "bert") and "architectures" not in data:  # HF BERT is "bert" too, with architectures
        from cse_models import load_model
        from cse_models.model import BERT, GPT

        if weights.name == "model.safetensors":
            return load_model(path).eval()
        model_cls = BERT if kind == "bert" else GPT
        model = model_cls(model_cls.config_class.from_dict(data))
        _load_into(model, load_state_dict(weights), path)
        return model.eval()
    return _load_hf(path, data, weights)


def _load_into(model, state: dict, path: Path) -> None:
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:
        raise ValueError(f"load_checkpoint: the weights in {path} do not match its config.json: "
                         f"{str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else err}") from None
    tied = {"lm_head.weight"} & set(missing)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"load_checkpoint: the weights in {path} do not match its config.json "
                         f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def _load_hf(path: Path, data: dict, weights: Path):
    try:
        import transformers
    except ImportError:
        raise fail("load_checkpoint", "path", "holds an HF model; install transformers (pip install "
                   "'ntkscope[hf]') to load it", str(path)) from None
    architectures = str(data.get("architectures"))
    if data.get("model_type") == "gpt2" or "LMHead" in architectures or "CausalLM" in architectures:
        auto = transformers.AutoModelForCausalLM
    elif "MaskedLM" in architectures:
        auto = transformers.AutoModelForMaskedLM
    else:
        auto = transformers.AutoModel
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"load_checkpoint: {path}/config.json is not a cse_models or HF config ({str(err)[:160]})") from None
    if weights.suffix == ".safetensors":
        try:
            return auto.from_pretrained(path, local_files_only=True, use_safetensors=True).eval()
        except (RuntimeError, ValueError, OSError) as err:
            raise ValueError(f"load_checkpoint: the weights in {path} do not match its config.json "
                             f"({str(err).splitlines()[0][:200]})") from None
    model = auto.from_config(hf_config)
    state = load_state_dict(weights)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"load_checkpoint: the weights in {weights} do not match its config.json "
                         f"({str(err).splitlines()[0][:200]})") from None
    return model.eval()


def model_vocab_size(model) -> int:
    return model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else \
        model.transformer.wte.num_embeddings


def checkpoint_tokenizer(path: str | Path, tokenizer=None):
    """The tokenizer for a checkpoint: ``tokenizer`` when named, else the checkpoint's
    ``tokenizer.json``, else (a ``cse_models`` run) the tokenizer its ``train_config.json`` used."""
    from ntkscope.tokenization import load_tokenizer

    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    for parent in (path, path.parent, path.parent.parent):
        cfg = parent / "train_config.json"
        if cfg.is_file():
            data = json.loads(cfg.read_text()).get("data", {})
            if data.get("tokenizer"):
                return load_tokenizer(data["tokenizer"])
            from ntkscope.corpus.pack import load_pack

            return load_pack(data.get("pack")).tokenizer()
    raise FileNotFoundError(f"checkpoint_tokenizer: {path} has no tokenizer.json and is not part of a cse_models "
                            "run; name one with --tokenizer (a tokenizer.json, an HF directory, or 'gpt2')")


def check_vocab(model, tokenizer, where: str = "load_checkpoint") -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    rows = model_vocab_size(model)
    if tokenizer.vocab_size > rows:
        raise ValueError(f"{where}: tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the model's "
                         f"embedding has {rows} rows: the vocabulary does not match the model")
