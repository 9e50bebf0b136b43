"""The finished run's Hugging Face folder: weights, ``config.json`` and the tokenizer in one
directory that ``from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` load with no
step path.

Written for ``hf_config`` and ``hf_pretrained`` models into ``poplar.output_dir``, by default
``<report_dir>/model`` (the run's outputs already live in the report directory; the checkpoint
directory keeps only ``step-N`` checkpoints, which pruning and resuming read). The weights go
through the checkpoints' own Hugging Face writer (``checkpoint.hf_layout``), so the two never
differ in layout. The tokenizer is the run's: the ``hf_pretrained`` directory's (all its files,
as ``AutoTokenizer`` reads them), ``poplar.data.tokenizer``'s ``tokenizer.json``, or for a
byte-level run the byte tokenizer as a Hugging Face one ([Note: the byte tokenizer as a Hugging
Face one]). ``Trainer.save_pretrained(dir, tokenizer)`` writes the same folder from Python, on
request.

The folder is written into a temporary sibling (``.NAME.tmp-*``), given the mode the user's umask
gives a new directory, and moved over any older folder; a successful write then removes the
temporaries that writes killed before it left behind.

[Note: the byte tokenizer as a Hugging Face one]
The byte-level pipeline (``poplar.workloads.text.ByteTokenizer``) encodes text as its UTF-8 bytes,
ids 0-255, and has four more ids: PAD, BOS, EOS, MASK = 256-259. Its Hugging Face twin is a
``tokenizers`` BPE model with no merges whose vocabulary is only the 256 byte tokens ``<0x00>`` ..
``<0xFF>`` at the ids of their bytes, with byte fallback: no character is in the vocabulary, so
every one falls back to its UTF-8 bytes, which is the pipeline's encoding exactly; the decoder
turns the byte tokens back into bytes and the bytes into text. The four specials are added as
``<pad>``, ``<s>``, ``</s>``, ``<mask>`` at 256-259 (the names ``poplar.workloads.tokenized``
looks up, so fine-tuning the folder with ``hf_pretrained`` gives the same ids), and split as text
where they appear in it (``split_special_tokens``), as the pipeline does. Without the file,
``AutoTokenizer`` would build an empty tokenizer from the model's type and say nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from poplar.checkpoint.export import export_model
from poplar.checkpoint.storage import publish, remove_replaced
from poplar.logs import log
from poplar.train.config import TrainConfig
from poplar.workloads.text import BOS, EOS, MASK, PAD

BYTE_SPECIALS = {PAD: "<pad>", BOS: "<s>", EOS: "</s>", MASK: "<mask>"}  # [Note: the byte tokenizer ...]
_TEMPORARY_SUFFIX = re.compile(r"[a-z0-9_]{8}")  # 8 hex digits (save_hf_folder); mkdtemp's 8 characters (earlier versions)


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
    leftovers = killed_writes(directory) if engine.rank == 0 else []  # before this write makes its own temporary
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"  # rank 0's export makes it
    try:
        export_model(engine, tmp)  # every rank; never the whole model at once (checkpoint.export)
        if engine.rank != 0:
            return
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        publish(tmp, directory)  # the umask's mode, then moved over any older folder
    except BaseException:
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    remove_replaced(directory)
    if tokenizer is None:  # AutoTokenizer.from_pretrained(directory) would build an empty one and say nothing
        log.info(f"model folder {directory} (from_pretrained loads it); no tokenizer saved: save the one that made "
                 f"the training ids into it (tokenizer.save_pretrained({str(directory)!r}))")
        return
    name = getattr(tokenizer, "name_or_path", "") or "given"
    log.info(f"model folder {directory} (from_pretrained loads it; tokenizer {name})")


def killed_writes(directory: Path) -> list[Path]:
    """The temporaries that writes of ``directory`` killed before they finished left beside it:
    directories named as ``save_hf_folder`` names its temporary, holding only files."""
    prefix = f".{directory.name}.tmp-"
    try:
        siblings = list(directory.parent.iterdir())
    except OSError:
        return []
    found = []
    for path in siblings:
        if not (path.name.startswith(prefix) and _TEMPORARY_SUFFIX.fullmatch(path.name[len(prefix):])):
            continue
        try:
            if path.is_dir() and not path.is_symlink() and \
                    all(entry.is_file() and not entry.is_symlink() for entry in path.iterdir()):
                found.append(path)
        except OSError:
            continue  # removed meanwhile
    return found


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
    """The run's tokenizer as ``save_hf_folder`` takes it: the ``hf_pretrained`` directory's,
    ``poplar.data.tokenizer``'s ``tokenizer.json`` as a fast tokenizer, or for a byte-level run the
    byte tokenizer (``byte_tokenizer``); None where the data came as a ``datasets`` directory's
    ``input_ids``, tokenized by a tokenizer the run never saw."""
    import transformers

    if cfg.model_hf_pretrained is not None and cfg.tokenizer is None:
        return transformers.AutoTokenizer.from_pretrained(cfg.model_hf_pretrained)
    if cfg.tokenizer is not None and cfg.tokenizer != "bytes":
        return transformers.PreTrainedTokenizerFast(tokenizer_file=cfg.tokenizer, name_or_path=cfg.tokenizer)
    return None if pretokenized(cfg.data_path) else byte_tokenizer()


def pretokenized(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a ``datasets`` directory with an ``input_ids`` column (its ids are
    taken as they are: ``poplar.workloads.tokenized``)."""
    info = Path(path) / "dataset_info.json" if path is not None else None
    if info is None or not info.is_file() or not (info.parent / "state.json").is_file():
        return False
    try:
        return "input_ids" in (json.loads(info.read_text()).get("features") or {})
    except (OSError, ValueError, AttributeError):
        return False


def byte_tokenizer() -> Any:
    """The byte-level pipeline's tokenizer as a ``transformers`` fast tokenizer that
    ``AutoTokenizer`` loads: the same ids for any text ([Note: the byte tokenizer as a Hugging
    Face one])."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(BYTE_SPECIALS[i], special=True, normalized=False)
                                for i in sorted(BYTE_SPECIALS)])
    names = {name: backend.token_to_id(name) for name in BYTE_SPECIALS.values()}
    if names != {name: i for i, name in BYTE_SPECIALS.items()}:  # the pipeline's ids, or no tokenizer at all
        raise RuntimeError(f"this tokenizers package gave the byte tokenizer's specials the ids {names}, not "
                           f"{ {name: i for i, name in BYTE_SPECIALS.items()} }: the saved tokenizer would not "
                           "match the data; install a tokenizers version that adds tokens in order")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, name_or_path="byte-level", split_special_tokens=True,
        pad_token=BYTE_SPECIALS[PAD], bos_token=BYTE_SPECIALS[BOS], eos_token=BYTE_SPECIALS[EOS],
        mask_token=BYTE_SPECIALS[MASK])
