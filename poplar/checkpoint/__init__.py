"""Checkpoints: every rank writes its own shards, in torch's own format, and a checkpoint loads
on another world size, ZeRO stage, plan or shard weights (``docs/checkpoint-format.md``).

A checkpoint is a directory that ``torch.distributed.checkpoint`` (DCP) reads::

    .metadata, __R_0.distcp        the DCP checkpoint: ``{"model": {name: tensor}, "optim": {"state":
                                   {name: {"exp_avg", ...}}, "param_groups": [...]}}``, the state dict
                                   ``get_state_dict`` gives for an FSDP2 model; every rank writes its
                                   own fp32 master and optimizer shards, nothing is gathered
    rng-rank{r}-of{N}.safetensors  rank r's RNG states ("rng/cpu", "rng/cuda")
    index.json                     format version 3, world size, stage, plan, iteration, the parameter
                                   table, the optimizer class and its groups' hyper-parameters, per
                                   rank the cut (the element ranges of flattened parameters it held)
                                   and every file with its size and sha256, the precision state and
                                   the caller's ``extra``

The cut: ``engine.stage.optimizer_segments()`` says, for each parameter the optimizer holds (a
model parameter at stage 0, a flat shard at stages 1-3), which element range of which model
parameter each part of it is. Each range is given to DCP as rectangles of the parameter in its
own shape, views of the shard (``cut``); a load asks for the rectangles of its own new ranges
and DCP reads only the saved chunks that overlap them (``sharded_load``), straight into the
ZeRO-3 master shards and the optimizer state being built; stages 0-2, which hold the whole
model on every rank, read it whole. FSDP2 loads a Poplar checkpoint with DCP and
``set_state_dict``; ``load_torch_checkpoint`` loads one torch wrote. Checkpoints of index
versions 1-2 (``model.safetensors`` and ``optim-rank{r}-of{N}.safetensors``) still load
(``reshard``).

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
groups, every file's size (all ranks) and the sha256 of every file (spread over the ranks)
before it reads; any problem on any rank raises ``CheckpointError`` on every rank
(``DamagedCheckpoint`` for a sha256 mismatch). Every rank must call both functions. All ranks
must see the same directory (a shared filesystem when ranks span machines).

Kept checkpoints (``save_kept``, what ``fit`` writes): a run's checkpoint directory holds one
step directory per checkpoint (``step-00000010``, each a checkpoint as above) and an index.json
pointing at the latest, written last; the newest ``keep`` are kept, every leftover of an
interrupted save is removed by the next one, and ``find_latest`` (as ``load_checkpoint`` and
``read_index`` given such a directory) takes the latest complete one (``poplar.checkpoint.kept``).
``start_save_kept`` writes one in the background (``background``: shards copied to host between
iterations, a thread writes them; ``CheckpointOptions.async_save``).

RNG: each rank's torch CPU RNG state (and its CUDA device's, on CUDA) is saved and restored on
the rank of the same number, so a resume on the same world size is bitwise on CPU. Ranks beyond
the saved world size keep their RNG. Data-loader position, LR schedulers and anything else of
the caller go in ``extra`` (JSON), e.g. ``extra={"data": loader.state_dict()}``.

The package: ``layout`` (file names, the index and how values are written in it), ``storage``
(atomic, durable writes), ``cut`` (the shards as DCP rectangles), ``snapshot`` (what a save
writes), ``save``, ``background`` (saves written while training goes on), ``sharded_load``,
``load``, ``reshard`` (the optimizer state of earlier checkpoints by name on load), ``kept`` (a
run's kept checkpoints and the pointer to the latest), ``lock`` (one job per checkpoint
directory: ``D/poplar.lock``, taken by ``fit`` before anything in D is deleted) and ``errors``
(failures raised on every rank together; ``DamagedCheckpoint`` when a file fails its sha256).
"""

from poplar.checkpoint.errors import CheckpointError, DamagedCheckpoint
from poplar.checkpoint.export import ExportReport, export_model
from poplar.checkpoint.kept import Latest, NoCompleteCheckpoint, find_latest, read_index, save_kept
from poplar.checkpoint.layout import DCP_FORMAT_VERSION as FORMAT_VERSION  # the version written
from poplar.checkpoint.layout import optim_file_name
from poplar.checkpoint.load import LoadedCheckpoint, load_checkpoint, load_torch_checkpoint
from poplar.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "load_torch_checkpoint", "LoadedCheckpoint", "read_index", "save_kept",
           "find_latest", "Latest", "export_model", "ExportReport",
           "CheckpointError",
           "DamagedCheckpoint", "NoCompleteCheckpoint",
           "FORMAT_VERSION", "optim_file_name"]
