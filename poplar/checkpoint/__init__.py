"""Checkpoints (safetensors) that resume exactly, and on another world size, ZeRO stage or plan.

A checkpoint is a directory::

    model.safetensors              the full model (engine.full_state_dict(), written by rank 0);
                                   plain ``model.load_state_dict(safetensors.torch.load_file(...))``
                                   works (tied weights are stored under each of their keys)
                                   (above ``max_shard_bytes``: Hugging Face shards
                                   ``model-0000i-of-0000N.safetensors`` and
                                   ``model.safetensors.index.json``; a ``transformers`` model
                                   also gets ``config.json``, so ``from_pretrained(dir)``
                                   loads it; ``checkpoint.hf_layout``)
    optim-rank{r}-of{N}.safetensors  rank r's optimizer state, cut by model parameter name and
                                   element range, plus its RNG states ("rng/cpu", "rng/cuda")
    index.json                     format version, world size, stage, plan, iteration, the
                                   parameter table (name, shape, dtype), the optimizer class and
                                   param-group hyper-parameters, every file with its size and
                                   sha256, per rank the table of its state pieces (and scalar
                                   state such as Adam's ``step``), and the caller's ``extra``

Optimizer state by name: ``engine.stage.optimizer_segments()`` says, for each parameter the
optimizer holds (a model parameter at stage 0, a flat shard at stages 1-3), which element range
of which model parameter each part of it is. Every per-element state tensor (Adam ``exp_avg``,
SGD ``momentum_buffer``, ...) is saved as one piece per (name, range); scalar state is saved in
the index per piece. On load each rank rebuilds the state of each of its new optimizer
parameters from the saved pieces that overlap its segments, reading only those ranges
(``safe_open``) from whichever old ranks' files hold them. A new shard that is all padding gets
zeros and its group's scalars. The rebuilt state goes through ``optimizer.load_state_dict``, so
torch applies its own device/dtype rules, and the param groups' hyper-parameters (lr, betas,
weight decay, ...; not implementation switches such as ``foreach``/``fused``) are restored.

Safety: files are written into a temporary directory next to the target, index.json last (it
carries the sha256 of its own canonical JSON, so a damaged index is refused), and the directory
is renamed into place, so a directory with a valid index is a complete checkpoint (an existing
checkpoint at the target is replaced; anything else there is refused). A failed save, also one
where a rank died, leaves a complete checkpoint there (the previous one, or the new one if rank 0
had moved it into place) and no temporary directory. Only if rank 0 dies does its temporary
``.NAME.tmp-*`` stay; a later save to the same directory removes it once nothing in it changed
for an hour (``storage.remove_stale_temporaries``: another job may be saving there). Should rank
0 die between the two renames that replace an older checkpoint, the older one is left as
``.NAME.old-*``; the next successful save to the directory removes it. Loading checks the
format, the index's checksum, the parameter table against the model, the optimizer class and
groups, every file's size (all ranks) and the sha256 of each file it reads; any problem on any
rank raises ``CheckpointError`` on every rank before anything is changed. Every rank must call
both functions (the model is gathered collectively at stage 3). All ranks must see the same
directory (a shared filesystem when ranks span machines).

Kept checkpoints (``save_kept``, what ``fit`` writes): a run's checkpoint directory holds one
step directory per checkpoint (``step-00000010``, each a checkpoint as above) and an index.json
pointing at the latest, written last; the newest ``keep`` are kept, every leftover of an
interrupted save is removed by the next one, and ``find_latest`` (as ``load_checkpoint`` and
``read_index`` given such a directory) takes the latest complete one (``poplar.checkpoint.kept``).

RNG: each rank's torch CPU RNG state (and its CUDA device's, on CUDA) is saved and restored on
the rank of the same number, so a resume on the same world size is bitwise on CPU. Ranks beyond
the saved world size keep their RNG. Data-loader position, LR schedulers and anything else of
the caller go in ``extra`` (JSON), e.g. ``extra={"data": loader.state_dict()}``.

The package: ``layout`` (file names, the index and how values are written in it), ``storage``
(atomic, durable writes), ``save``, ``load``, ``reshard`` (optimizer state by name on load),
``kept`` (a run's kept checkpoints and the pointer to the latest), ``lock`` (one job per checkpoint
directory: ``D/poplar.lock``, taken by ``fit`` before anything in D is deleted) and ``errors``
(failures raised on every rank together; ``DamagedCheckpoint`` when a file fails its sha256).
"""

from poplar.checkpoint.errors import CheckpointError, DamagedCheckpoint
from poplar.checkpoint.kept import Latest, NoCompleteCheckpoint, find_latest, read_index, save_kept
from poplar.checkpoint.layout import FORMAT_VERSION, optim_file_name
from poplar.checkpoint.load import LoadedCheckpoint, load_checkpoint, load_torch_checkpoint
from poplar.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "load_torch_checkpoint", "LoadedCheckpoint", "read_index", "save_kept", "find_latest", "Latest",
           "CheckpointError",
           "DamagedCheckpoint", "NoCompleteCheckpoint",
           "FORMAT_VERSION", "optim_file_name"]
