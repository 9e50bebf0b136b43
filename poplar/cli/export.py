"""``poplar export``: the whole model out of a sharded checkpoint, offline, in one CPU process.

    poplar export CHECKPOINT_DIR OUT_DIR [--hf] [--max-shard-size 5GB]

Reads the ``torch.distributed.checkpoint`` checkpoint in CHECKPOINT_DIR (its ``"model"``) one
tensor at a time and writes ``OUT_DIR/model.safetensors`` (Hugging Face shards above the size);
``--hf`` also copies the checkpoint's ``config.json``, generation config and tokenizer files, so
``from_pretrained(OUT_DIR)`` loads it (``poplar.checkpoint.dcp_export``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from poplar.checkpoint.dcp_export import export_dcp
from poplar.checkpoint.hf_layout import shard_bytes


def size_arg(text: str) -> int:
    """A ``--max-shard-size`` value: bytes, or e.g. "500MB", "2GiB"."""
    try:
        return shard_bytes(int(text) if text.isdigit() else text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write the whole model of a sharded checkpoint as model.safetensors",
                              description="Write the model of a sharded (torch.distributed.checkpoint) checkpoint "
                                          "as model.safetensors, one tensor at a time, in this process alone.")
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR", help="the sharded checkpoint's directory")
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="where model.safetensors goes (made if missing)")
    p.add_argument("--hf", action="store_true",
                   help="a Hugging Face folder: also copy the checkpoint's config.json, generation config and "
                        "tokenizer files (from_pretrained(OUT_DIR) loads it)")
    p.add_argument("--max-shard-size", type=size_arg, default=None, metavar="SIZE",
                   help="above this many bytes (or e.g. 500MB) the weights are Hugging Face shards with "
                        "model.safetensors.index.json (default 5GB)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    done = export_dcp(args.checkpoint, args.out, hf=args.hf, max_shard_bytes=args.max_shard_size)
    files = [e["file"] for e in done.entry.get("shards", [done.entry])]
    print(f"wrote {args.out}: {done.tensors} tensors, {done.total_bytes} bytes in {', '.join(files)}"
          + (f"; copied {', '.join(done.copied)}" if done.copied else "")
          + f" (at most {done.peak_tensor_bytes} bytes of the model held at once)")
    return 0
