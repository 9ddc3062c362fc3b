"""Reading weights without running code: safetensors, or a pickle through
``torch.load(weights_only=True)``, which refuses any pickle that would import or call code;
such a file is reported, never executed."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch

from ntkscope.core.checks import UserError
from ntkscope.core.files import load_safetensors
from ntkscope.core.memory import check_fits

STATE_DICT_NAMES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")


def weights_file(path: Path) -> Path | None:
    """The weights of a checkpoint directory: ``model.safetensors``, else a plain state dict."""
    for name in ("model.safetensors", *STATE_DICT_NAMES):
        if (path / name).is_file():
            return path / name
    return None


def load_state_dict(path: str | Path) -> dict:
    """A state dict from safetensors, or from a pickle through ``torch.load(weights_only=True)``.

    A pickle that would import or run code is refused with a clear error, never executed."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_safetensors(path, "load_checkpoint")
    if path.stat().st_size == 0:
        raise UserError(f"load_checkpoint: {path} is empty")
    check_fits(path.stat().st_size // 4, 4, f"load_checkpoint: {path}")  # a state dict is about its file's size
    try:
        with warnings.catch_warnings():  # torch warns about the refused global; the error below says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, ValueError) as err:
        text = str(err)
        if "Weights only load failed" in text:  # torch's safe unpickler refused it: nothing ran
            found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
            lines = [line.strip() for line in text.splitlines()[1:] if line.strip() and "documentation" not in line]
            why = f"it imports {found.group(1)}" if found else (lines[-1] if lines else "not plain tensors")
            raise UserError(f"load_checkpoint: {path} is a pickle that would run code, refused, never executed "
                            f"({why[:120]}); save the weights as safetensors") from None
        first = (str(err).splitlines() or [type(err).__name__])[0][:160]
        raise UserError(f"load_checkpoint: {path} is not a readable PyTorch state dict ({first})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UserError(f"load_checkpoint: {path} does not hold a state dict of tensors")
    return state
