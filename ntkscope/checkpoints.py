"""Finding and loading checkpoints: a training run's directory (``cse_models``' layout,
``RUN/checkpoints/step-NNNNNN``), a single ``cse_models`` checkpoint, or an HF model
directory. Loading reads ``config.json`` + safetensors; nothing is unpickled."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ntkscope._checks import fail

_STEP = re.compile(r"^step-(\d+)$")


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


def load_checkpoint(path: str | Path):
    """A ``cse_models`` GPT/BERT, or an HF model (``transformers.AutoModel``) for other configs."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"load_checkpoint: {path} has no config.json")
    data = json.loads(config.read_text())
    kind = data.get("model_type")
    if kind in ("gpt", "bert") and "architectures" not in data:  # HF BERT is "bert" too, with architectures
        from cse_models import load_model

        return load_model(path).eval()
    try:
        import transformers
    except ImportError:
        raise fail("load_checkpoint", "path", "holds an HF model; install transformers to load it", str(path)) from None
    architectures = str(data.get("architectures"))
    if kind == "gpt2" or "LMHead" in architectures or "CausalLM" in architectures:
        return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True).eval()
    if "MaskedLM" in architectures:
        return transformers.AutoModelForMaskedLM.from_pretrained(path, local_files_only=True, use_safetensors=True).eval()
    return transformers.AutoModel.from_pretrained(path, local_files_only=True, use_safetensors=True).eval()
