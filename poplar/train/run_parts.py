"""What a run built from a ``TrainConfig`` (``poplar.train.from_config``) needs before the engine: the model, optimizer, loss,
training and held-out data, and the profile a resumed run may reuse.

Models (``poplar.model``): a built-in name (``llama-small``, ``bert-tiny``, ...), a Hugging Face
``config.json`` (``{"hf_config": path, ...overrides}``: ``AutoModelForCausalLM.from_config``,
randomly initialised from the config's seed; needs ``poplar[hf]``), a pretrained model to
fine-tune (``{"hf_pretrained": dir}``: ``AutoModelForCausalLM.from_pretrained`` of a local
directory, in fp32, tokenized by the directory's ``tokenizer.json``), or a user factory
``"package.module:function"`` called with the overrides as keyword arguments, returning an
``nn.Module`` whose ``forward(**batch)`` takes Hugging Face batches (``input_ids``,
``attention_mask``) and returns logits or an output with ``.logits``.

Data: causal-LM models train on ``poplar.workloads.tokenized.TokenizedText`` (a text or JSONL
file, byte-level or ``tokenizer.json`` tokens, packed or padded) with the token-weighted
``(loss_sum, count)`` causal-LM loss, so padded samples weigh every real token once; BERT models
keep the masked-LM byte blocks. The held-out set is the last ``eval_fraction`` of the samples, or
``eval_path``.

Profile reuse: auto mode's profile is saved beside the checkpoints (``profile.json``) with a
fingerprint of what it depends on (the model's parameter names and shapes, the cluster or the
GPUs, the ZeRO stage asked for, the precision, the world size, the sample shape). A restart whose
fingerprint matches plans from it instead of profiling again; rank 0 decides and every rank gets
its answer.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from poplar.train.config import ConfigError, TrainConfig
from poplar.logs import log


@dataclass
class RunParts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    train_data: Any
    eval_data: Any | None
    about_data: str


def _hf_model(cfg: TrainConfig, vocab: int) -> nn.Module:
    kind = "hf_pretrained" if cfg.model_hf_pretrained is not None else "hf_config"
    try:
        import transformers
    except ImportError:
        raise ConfigError(f'"poplar.model.{kind}" needs transformers: pip install \'poplar[hf]\'') from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # one bar per rank while loading says nothing
    if cfg.model_hf_pretrained is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_hf_pretrained, **cfg.model_overrides)
        _check_vocab(getattr(model.config, "vocab_size", None), vocab)
        return model.to(torch.float32)  # fp32 master weights; "bf16" / "fp16" set the compute precision
    path = Path(cfg.model_hf_config or "")
    if not path.is_file():
        raise ConfigError(f'"poplar.model.hf_config": {path} is not a file; give a Hugging Face config.json')
    config = transformers.AutoConfig.from_pretrained(str(path), **cfg.model_overrides)
    _check_vocab(getattr(config, "vocab_size", None), vocab)
    torch.manual_seed(cfg.seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def _check_vocab(have: int | None, vocab: int) -> None:
    if have is not None and have < vocab:
        raise ConfigError(f"the model's vocab_size {have} is smaller than the tokenizer's {vocab}; use the model's "
                          "own tokenizer.json or set \"vocab_size\" in poplar.model")


def tokenizer_path(cfg: TrainConfig) -> str | None:
    """The tokenizer: ``poplar.data.tokenizer`` if given; for ``hf_pretrained``, the directory's
    own ``tokenizer.json`` (a pretrained model's token ids mean nothing under another tokenizer);
    else None (byte-level)."""
    if cfg.tokenizer is not None or cfg.model_hf_pretrained is None:
        return cfg.tokenizer
    directory = Path(cfg.model_hf_pretrained)
    if not directory.is_dir():
        raise ConfigError(f'"poplar.model.hf_pretrained": {directory} is not a directory; give the directory a model '
                          "was saved to with save_pretrained")
    own = directory / "tokenizer.json"
    if not own.is_file():
        raise ConfigError(f'"poplar.model.hf_pretrained": {directory} has no tokenizer.json; save the tokenizer there '
                          '(a fast tokenizer\'s save_pretrained writes it) or give "poplar.data.tokenizer" ("bytes": '
                          "byte-level)")
    return str(own)


def _factory_model(cfg: TrainConfig) -> nn.Module:
    module_name, _, fn_name = (cfg.model_factory or "").partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f'"poplar.model": cannot import {cfg.model_factory!r} ({type(e).__name__}: {e}); give '
                          '"package.module:function" importable from the current directory or PYTHONPATH') from None
    torch.manual_seed(cfg.seed)
    model = fn(**cfg.model_overrides)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{cfg.model_factory} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def builtin_causal_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) of a built-in Llama-style model, which takes the token tensor alone."""
    from poplar.workloads.hf import causal_lm_loss

    return causal_lm_loss(model(batch["input_ids"]), batch["labels"])


def build_parts(cfg: TrainConfig, device: torch.device) -> RunParts:
    """Model (on ``device``), optimizer, loss and datasets of ``cfg``."""
    from poplar.workloads.hf import causal_lm_loss_fn
    from poplar.workloads.models import create_model, loss_fn_for
    from poplar.workloads.text import MaskedTextBlocks
    from poplar.workloads.tokenized import TextTokenizer, TokenizedText, describe

    cfg.check_model()
    if cfg.model_hf_config is None and cfg.model_hf_pretrained is None and cfg.model_factory is None and \
            str(cfg.model).startswith("bert"):
        overrides = {"max_seq_len": max(cfg.seq_len, 8), **cfg.model_overrides}
        model = create_model(cfg.model, seed=cfg.seed, **overrides)
        train = MaskedTextBlocks(cfg.data_path, seq_len=cfg.seq_len, split="train")
        held = MaskedTextBlocks(cfg.data_path, seq_len=cfg.seq_len, split="val") if cfg.eval_fraction else None
        loss_fn, about = loss_fn_for(model), f"{len(train)} masked byte blocks of {cfg.seq_len}"
    else:
        tokenizer = TextTokenizer(tokenizer_path(cfg))
        if cfg.model_hf_config is not None or cfg.model_hf_pretrained is not None:
            model, loss_fn = _hf_model(cfg, tokenizer.vocab_size), causal_lm_loss_fn
        elif cfg.model_factory is not None:
            model, loss_fn = _factory_model(cfg), causal_lm_loss_fn
        else:
            overrides = {"max_seq_len": max(cfg.seq_len, 8), "vocab_size": tokenizer.vocab_size, **cfg.model_overrides}
            model, loss_fn = create_model(cfg.model, seed=cfg.seed, **overrides), builtin_causal_loss
        kwargs = {"seq_len": cfg.seq_len, "tokenizer": tokenizer, "packing": cfg.packing, "text_key": cfg.text_key}
        if cfg.eval_path is not None:
            train, held = TokenizedText(cfg.data_path, **kwargs), TokenizedText(cfg.eval_path, **kwargs)
        elif cfg.eval_fraction:
            train = TokenizedText(cfg.data_path, split="train", val_fraction=cfg.eval_fraction, **kwargs)
            held = TokenizedText(cfg.data_path, split="val", val_fraction=cfg.eval_fraction, **kwargs)
        else:
            train, held = TokenizedText(cfg.data_path, **kwargs), None
        about = describe(train)
    model = model.to(device)
    try:
        optimizer = getattr(torch.optim, cfg.optimizer)(model.parameters(), **cfg.optimizer_params)
    except TypeError as e:
        raise ConfigError(f'"optimizer.params" do not fit torch.optim.{cfg.optimizer}: {e}') from None
    if held is not None:
        about += f"; {len(held)} held out for evaluation"
    return RunParts(model, optimizer, loss_fn, train, held, about)


# ---------------------------------------------------------------------- profile reuse
def profile_fingerprint(cfg: TrainConfig, model: nn.Module, sample: Any, world: int,
                        auto_device: Any = None) -> dict[str, Any]:
    """What a profile depends on (JSON-safe): equal fingerprints, reusable profile.
    ``auto_device``: the device auto mode profiles on where it is not this rank's GPU; an emulated
    GPU names its whole cluster (``ClusterDevice.cluster``)."""
    params = hashlib.sha256(repr([(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()])
                            .encode()).hexdigest()
    shapes = {k: list(v.shape) for k, v in sample.items()} if isinstance(sample, dict) else list(sample.shape)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else None
    cluster = getattr(auto_device, "cluster", None)
    return {"model": params, "cluster": cluster.to_dict() if cluster is not None else None,
            "gpus": gpus, "zero_stage": cfg.zero_stage, "world_size": world, "sample": shapes,
            "precision": str(cfg.mixed_precision.precision) if cfg.mixed_precision is not None else "fp32",
            "bucket_size_mb": cfg.bucket_size_mb, "activation_checkpointing": repr(cfg.activation_checkpointing)}


def saved_profile_paths(cfg: TrainConfig) -> tuple[Path, Path] | None:
    if cfg.checkpoint_dir is None:
        return None
    return Path(cfg.checkpoint_dir) / "profile.json", Path(cfg.checkpoint_dir) / "profile.fingerprint.json"


def reusable_profile(cfg: TrainConfig, fingerprint: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """Rank 0's verdict, shared with every rank: the saved profile (as a dict) when its
    fingerprint equals this run's, else None."""
    import torch.distributed as dist

    found: list[Any] = [None]
    paths = saved_profile_paths(cfg)
    if rank == 0 and paths is not None and cfg.resume and paths[0].is_file() and paths[1].is_file():
        try:
            if json.loads(paths[1].read_text()) == fingerprint:
                found[0] = json.loads(paths[0].read_text())
                log.info(f"reusing the profile saved with the checkpoints ({paths[0]}): model, cluster and stage "
                         "are unchanged")
            else:
                log.info(f"not reusing {paths[0]}: the model, cluster, stage or precision changed; profiling again")
        except (OSError, ValueError) as e:
            log.warning(f"cannot read the saved profile {paths[0]} ({e}); profiling again")
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    return found[0]


def save_profile(cfg: TrainConfig, profile: Any, fingerprint: dict[str, Any], rank: int) -> None:
    """Rank 0 keeps the profile and its fingerprint beside the checkpoints."""
    from poplar.types.plans import write_text_atomic

    paths = saved_profile_paths(cfg)
    if rank != 0 or paths is None or profile is None:
        return
    os.makedirs(paths[0].parent, exist_ok=True)
    profile.save(paths[0])
    write_text_atomic(paths[1], json.dumps(fingerprint, indent=1) + "\n")
