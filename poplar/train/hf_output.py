"""The finished run's Hugging Face folder: weights, ``config.json`` and the tokenizer in one
directory that ``from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` load with no
step path.

Written for ``hf_config`` and ``hf_pretrained`` models into ``poplar.output_dir``, by default
``<report_dir>/model`` (the run's outputs already live in the report directory; the checkpoint
directory keeps only ``step-N`` checkpoints, which pruning and resuming read). The weights go
through the checkpoints' own Hugging Face writer (``checkpoint.hf_layout``), so the two never
differ in layout. The tokenizer is the run's: the ``hf_pretrained`` directory's (all its files,
as ``AutoTokenizer`` reads them) or ``poplar.data.tokenizer``'s ``tokenizer.json``; a byte-level
run has no Hugging Face tokenizer to save. ``Trainer.save_pretrained(dir, tokenizer)`` writes the
same folder from Python, on request.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from poplar.checkpoint.export import export_model
from poplar.logs import log
from poplar.train.config import TrainConfig


def output_dir(cfg: TrainConfig) -> Path | None:
    """Where the run's Hugging Face folder goes: ``poplar.output_dir``, else ``<report_dir>/model``;
    None for a model that is not a Hugging Face one or a run with neither directory."""
    if cfg.model_hf_config is None and cfg.model_hf_pretrained is None:
        return None
    if cfg.output_dir is not None:
        return Path(cfg.output_dir)
    return None if cfg.report_dir is None else Path(cfg.report_dir) / "model"


def save_hf_folder(engine: Any, directory: str | os.PathLike, tokenizer: Any = None) -> None:
    """Every rank (the weights are streamed one block at a time, a collective at ZeRO-3); rank 0
    writes ``directory`` whole: into a temporary sibling, then renamed over any older folder.
    ``tokenizer`` (anything with ``save_pretrained(dir)``, e.g. a ``transformers`` tokenizer;
    None: none) is saved beside the weights."""
    check_hf_model(engine.module)
    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"  # rank 0's export makes it
    try:
        export_model(engine, tmp)  # every rank; never the whole model at once (checkpoint.export)
        if engine.rank != 0:
            return
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    name = (getattr(tokenizer, "name_or_path", "") or "given") if tokenizer is not None else "none"
    log.info(f"model folder {directory} (from_pretrained loads it; tokenizer {name})")


def check_hf_model(module: Any) -> None:
    """A Hugging Face folder needs a ``transformers`` model (its ``config.json`` is what
    ``from_pretrained`` builds the model from); the same answer on every rank, before any
    collective."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        raise TypeError(f"save_pretrained writes a Hugging Face folder, which needs a transformers model; this "
                        f"engine trains a {type(module).__name__}: save a checkpoint instead "
                        "(fit(..., checkpoint=CheckpointOptions(dir)))")


def run_tokenizer(cfg: TrainConfig) -> Any:
    """The run's tokenizer as ``save_hf_folder`` takes it: the ``hf_pretrained`` directory's, or
    ``poplar.data.tokenizer``'s ``tokenizer.json`` as a fast tokenizer; None for a byte-level run."""
    import transformers

    if cfg.model_hf_pretrained is not None and cfg.tokenizer is None:
        return transformers.AutoTokenizer.from_pretrained(cfg.model_hf_pretrained)
    if cfg.tokenizer is None or cfg.tokenizer == "bytes":
        return None
    return transformers.PreTrainedTokenizerFast(tokenizer_file=cfg.tokenizer, name_or_path=cfg.tokenizer)
