"""Checkpoints behind one function: a training run's directory (``cse_models``' layout,
``RUN/checkpoints/step-NNNNNN``; a directory of ``stepN`` checkpoints, the names of Pythia's
training-checkpoint revisions; or a Hugging Face ``Trainer``'s ``output_dir`` of
``checkpoint-N`` folders, whose ``trainer_state.json`` says the step), a ``cse_models``
checkpoint, an HF model directory, or a plain state dict (``*.bin`` / ``*.pt``) beside a
``config.json``.

Safe by default: weights come from safetensors, or from ``torch.load(weights_only=True)``,
which refuses any pickle that would import or call code; such a file is reported, never
executed. The tokenizer comes with the checkpoint (``tokenizer.json``; for a
``cse_models`` run, the corpus pack named in its ``train_config.json``) or is named.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ntkscope.core.checks import MissingInput, UserError, check_path
from ntkscope.runs.families import family_for_config, family_of
from ntkscope.runs.weights import STATE_DICT_NAMES, weights_file
from ntkscope.text.inputs import as_source
from ntkscope.text.tokenization import load_tokenizer
from ntkscope.text.trained_with import tokenizer_near

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-?(\d+)$")  # cse_models' step-000100, Pythia's step1000
_TRAINER = re.compile(r"^checkpoint-(\d+)$")  # transformers.Trainer's checkpoint-500


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and weights_file(path) is not None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and _complete(p)]
    return sorted(found)


def _trainer_dirs(root: Path) -> list[tuple[int, Path]]:
    """``Trainer``'s ``checkpoint-N`` folders with a model in them; the step is ``trainer_state.json``'s
    ``global_step`` where it says one (a folder renamed by hand keeps its real step)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _TRAINER.match(path.name)
        if match and _complete(path):
            step = int(match.group(1))
            try:
                state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                state = None  # no (readable) trainer state: the folder's name says the step
            said = state.get("global_step", step) if isinstance(state, dict) else step
            if isinstance(said, bool) or not isinstance(said, int) or said < 0:
                raise UserError(f"list_checkpoints: {path / 'trainer_state.json'}: global_step must be a step, an "
                                f"integer >= 0 (got {said!r})")
            found.append((said, path))
    steps = [s for s, _ in found]
    same = sorted({s for s in steps if steps.count(s) > 1})
    if same:
        folders = sorted(p.name for s, p in found if s == same[0])
        raise UserError(f"list_checkpoints: {root} holds {len(folders)} checkpoints of step {same[0]} "
                        f"({', '.join(folders)}, by their trainer_state.json's global_step); keep one of them")
    return sorted(found)


def is_run_dir(path: str | Path) -> bool:
    """A ``cse_models`` run (``checkpoints/``), a directory of ``stepN`` checkpoints, or a ``Trainer``
    output directory with ``checkpoint-N`` folders (even with the final model saved beside them:
    name that folder's path to analyse the final model alone)."""
    path = Path(path)
    return (path / "checkpoints").is_dir() or bool(_trainer_dirs(path)) or (
        not (path / "config.json").is_file() and bool(_step_dirs(path)))


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """[(step, path)] of a run's complete checkpoints (config.json and weights), in step order."""
    check_path("run_dir", run_dir, func="list_checkpoints")
    run_dir = Path(run_dir)
    found = _step_dirs(run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir) \
        or _trainer_dirs(run_dir)
    if not found:
        raise MissingInput(f"list_checkpoints: run_dir {run_dir} has no checkpoints (expected "
                           "checkpoints/step-NNNNNN, stepN or a Trainer's checkpoint-N directories with config.json "
                           "and weights)")
    return found


def load_checkpoint(path: str | Path):
    """The model of a checkpoint directory, in eval mode.

    ``cse_models`` GPT/BERT (``config.json`` with ``model_type`` gpt/bert), or an HF model
    (``transformers``: GPT-2-style causal LMs, BERT-style MLMs and encoders), with weights
    from ``model.safetensors`` or a plain state dict (``pytorch_model.bin``, ``model.pt``).
    """
    check_path("path", path, func="load_checkpoint")
    path = Path(path)
    if not path.exists():
        what = "is a symbolic link to nothing, or a loop of links" if path.is_symlink() else "does not exist"
        raise MissingInput(f"load_checkpoint: {path} {what}")
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        hint = " (a training run: use its checkpoints/step-NNNNNN)" if is_run_dir(path) else ""
        raise MissingInput(f"load_checkpoint: {path} is not a checkpoint directory: it has no config.json{hint}")
    weights = weights_file(path)
    if weights is None:
        raise MissingInput(f"load_checkpoint: {path} has no weights (model.safetensors or one of "
                           f"{list(STATE_DICT_NAMES)})")
    try:
        data = json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"load_checkpoint: {config} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"load_checkpoint: {config} must hold a JSON object (got {type(data).__name__})")
    family = family_for_config(data)
    if family is None:
        raise UserError(f"load_checkpoint: {config} is not a cse_models or HF config (no model_type)")
    return family.load(path, data, weights)


def model_vocab_size(model) -> int:
    return family_of(model).vocab_size(model)


def checkpoint_tokenizer(path: str | Path, tokenizer=None, data=None):
    """The one tokenizer resolution: ``tokenizer`` when named, else the checkpoint's
    ``tokenizer.json``, else (a ``cse_models`` run or one of its checkpoints) the tokenizer its
    ``train_config.json`` used, else a ``tokenizer.json`` beside the checkpoint (a directory
    of ``stepN`` checkpoints), else the BPE of ``data`` when that is a corpus pack
    (``"default"``: the shipped one). Check it against the model with :func:`check_vocab`."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    near = tokenizer_near(path)
    if near is not None:
        return near
    source = as_source(data)
    if source.kind == "pack":
        return source.pack().tokenizer()
    raise MissingInput(f"checkpoint_tokenizer: {path} has no tokenizer.json and is not part of a cse_models "
                       "run; name one with --tokenizer (a tokenizer.json, an HF directory, or 'gpt2')")


def check_vocab(model, tokenizer, where: str = "load_checkpoint") -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    rows = model_vocab_size(model)
    if tokenizer.vocab_size > rows:
        raise UserError(f"{where}: tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the model's "
                        f"embedding has {rows} rows: the vocabulary does not match the model")


def schedule_length(run_dir: str | Path) -> int | None:
    """The number of training steps a run was scheduled for: ``train_config.json``'s ``steps``
    (a ``cse_models`` run) or the last ``checkpoint-N``'s ``trainer_state.json`` ``max_steps``
    (a ``Trainer`` run); None when neither says."""
    run_dir = Path(run_dir)
    candidates = [(run_dir / "train_config.json", "steps")]
    trainer = _trainer_dirs(run_dir)
    if trainer:
        candidates.append((trainer[-1][1] / "trainer_state.json", "max_steps"))
    for path, key in candidates:
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def trainer_checkpoints(root: str | Path) -> list[Path]:
    """A ``Trainer`` output folder's ``checkpoint-N`` folders that hold a model, in step order
    ([] when it has none)."""
    return [path for _, path in _trainer_dirs(Path(root))]
