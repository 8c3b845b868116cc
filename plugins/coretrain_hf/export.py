"""``coretrain checkpoint export RUN_DIR --format hf --to DIR``: a directory ``from_pretrained`` loads.

The checkpoint holds the wrapper's state dict (keys prefixed ``hf.``); the model's config is the
one the run trained with, saved by the provider in ``RUN_DIR/hf-config/``. The weights are
loaded into a freshly built transformers model (strictly: every key must fit) and written with
its own ``save_pretrained``, so tied weights, sharding and the config come out as transformers
expects. The tokenizer the run's data used is copied alongside. LoRA adapters are written as a
PEFT adapter directory, or with ``--merge-lora`` merged into the base weights.

Nothing read from the run directory decides whether code runs: its ``hf-config`` may name
``auto_map`` classes and its manifest any tokenizer directory, so a custom architecture's or
tokenizer's code runs only with the command's ``--trust-remote-code`` (the user's word), never
with the ``[tokenizer] trust_remote_code`` the run's manifest records.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from coretrain_tokenizer import REMOTE_CODE

from coretrain import UserError, require

if TYPE_CHECKING:
    from coretrain_hf import HFModel

CONFIG_DIR = "hf-config"
PREFIX = "hf."


def save_config(model: Any, output_dir: Path) -> None:
    """Record the transformers config the run trains (rank 0, at the start of training)."""
    model.config.save_pretrained(output_dir / CONFIG_DIR)


def refuse_used_destination(to: Path) -> None:
    """``--to`` is a new or empty directory: an export never writes into one that holds files."""
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UserError(f"--to: {to} exists and is not an empty directory; name a new one")


def save_pretrained(
    provider: HFModel,
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    run_dir: Path,
    to: Path,
    options: dict[str, Any],
) -> str:
    transformers = require("transformers", needed_by="checkpoint export --format hf", extra="hf")
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards": one line says what was written
    from coretrain_hf import DTYPES, TASKS

    refuse_used_destination(to)
    saved = run_dir / CONFIG_DIR
    trusted = bool(options.get("trust_remote_code"))  # the user's flag; never the run directory's word
    with refusing_remote_code(saved if (saved / "config.json").is_file() else provider.path, "model", trusted):
        hf_config = (
            transformers.AutoConfig.from_pretrained(saved, local_files_only=True, trust_remote_code=trusted)
            if (saved / "config.json").is_file()
            else provider.model_config(trust_remote_code=trusted)
        )
    weights = {name.removeprefix(PREFIX): tensor for name, tensor in state.items()}
    auto = getattr(transformers, TASKS[provider.task])
    lora = lora_settings(config)
    if lora is None:
        with refusing_remote_code(saved, "model", trusted):
            model = auto.from_config(hf_config, dtype=DTYPES[provider.dtype], trust_remote_code=trusted)
        load_strictly(model, weights)
        what = "model"
    else:
        from coretrain_hf.lora import export_adapters

        frozen_saved = config.get("checkpoint", {}).get("save_frozen", True)
        if frozen_saved:
            with refusing_remote_code(saved, "model", trusted):
                base = auto.from_config(hf_config, dtype=DTYPES[provider.dtype], trust_remote_code=trusted)
        elif provider.path is not None:  # the checkpoint holds the adapters; the base is where it came from
            with refusing_remote_code(provider.path, "model", trusted):
                base = auto.from_pretrained(
                    provider.path,
                    config=hf_config,
                    local_files_only=True,
                    dtype=DTYPES[provider.dtype],
                    trust_remote_code=trusted,
                )
        else:
            raise UserError(
                "the checkpoint holds only the adapters (checkpoint.save_frozen = false) and the base model was "
                "randomly initialised (no model.options.path): its weights are not saved anywhere"
            )
        model, what = export_adapters(base, weights, lora, merge=bool(options.get("merge_lora")))
        if not options.get("merge_lora") and provider.path is not None:
            model.peft_config["default"].base_model_name_or_path = str(Path(provider.path).resolve())
    to.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(to)
    return f"wrote {to}: {type(model).__name__} {what}" + copy_preprocessing(config, to, trusted)


def lora_settings(config: dict[str, Any]) -> Any:
    """The run's [plugins.lora] settings, when it trained adapters."""
    table = dict(config.get("plugins", {}).get("lora") or {})
    if "lora" not in config.get("plugins", {}) or not table.pop("enabled", True):
        return None
    from coretrain_hf.lora import LoRA

    return LoRA(**table)


def load_strictly(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor goes somewhere and every model tensor is filled (tied ones aside)."""
    result = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise UserError(
            "the checkpoint does not fit the model its run recorded: "
            f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""The settings of what prepares an image's or a sound's values for the model (``AutoImageProcessor``,
``AutoFeatureExtractor``, ``AutoProcessor``), saved beside a model by ``save_pretrained``."""


def copy_preprocessing(config: dict[str, Any], to: Path, trusted: bool) -> str:
    """What turns inputs into the model's, next to the weights, as transformers' pipelines load
    it: the tokenizer (:func:`copy_tokenizer`) and the processor settings in the directory the
    model came from (copied as they are: their JSON runs nothing). Said for the export's line."""
    said = ""
    tokenizer = copy_tokenizer(config, to, trusted)
    if tokenizer:
        said += f", tokenizer copied from {tokenizer}"
    source = config.get("model", {}).get("options", {}).get("path")
    processors = [Path(source) / name for name in PROCESSOR_FILES] if isinstance(source, str) and source else []
    for found in [path for path in processors if path.is_file()]:
        shutil.copyfile(found, to / found.name)
        said += f", {found.name} copied from {source}"
    return said


def copy_tokenizer(config: dict[str, Any], to: Path, trusted: bool = False) -> str | None:
    """The tokenizer the run's data (or its model directory) used, saved next to the weights."""
    candidates = [
        config.get("tokenizer", {}).get("path"),
        config.get("data", {}).get("options", {}).get("tokenizer"),
        config.get("model", {}).get("options", {}).get("path"),
    ]
    for candidate in candidates:
        if isinstance(candidate, str) and candidate and (Path(candidate) / "tokenizer_config.json").is_file():
            transformers = require("transformers", needed_by="checkpoint export --format hf", extra="hf")
            with refusing_remote_code(candidate, "tokenizer", trusted):
                loaded = transformers.AutoTokenizer.from_pretrained(
                    candidate, local_files_only=True, trust_remote_code=trusted
                )
            loaded.save_pretrained(to)
            return str(candidate)
    return None


@contextmanager
def refusing_remote_code(directory: Path | str | None, what: str, trusted: bool) -> Iterator[None]:
    """transformers' refusal to run a directory's code (``auto_map``) as one line naming the flag
    that allows it; ``directory`` is the one named in the message."""
    try:
        yield
    except (OSError, ValueError, KeyError, UserError) as exc:
        if trusted or REMOTE_CODE not in str(exc):
            raise
        raise UserError(
            f"--format hf: the {what} in {directory} ships code of its own to run; pass --trust-remote-code "
            "to run it (only for a run directory you trust: the directory, not its config, decides what runs)"
        ) from None
