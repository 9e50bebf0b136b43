"""One rank of a door's job under torchrun that trains until the test stops a rank: ``python -m
tests.integrations.stalled_rank DOOR DIR TIMEOUT_S`` (DOOR: ``lightning`` or ``hf``) trains a
toy model on 2 ranks for many steps with the collective timeout TIMEOUT_S; each rank writes its
pid to ``DIR/pid<rank>`` and, after every step, the step to ``DIR/step<rank>``."""

import os
import sys
from pathlib import Path

import torch

STEPS = 100_000  # more than the test waits for: the job ends only by the stopped rank
ROWS = ((2, 1, 2), (3, 1, 3))  # 5 samples a step on 2 ranks


def mark(directory: Path, rank: int, step: int) -> None:
    tmp = directory / f".step{rank}"
    tmp.write_text(str(step))
    os.replace(tmp, directory / f"step{rank}")


def lightning(directory: Path, timeout_s: float) -> None:
    import lightning.pytorch as pl

    from poplar.integrations.lightning import PoplarStrategy
    from tests import toy
    from tests.integrations import lightning_jobs as jobs

    class Marks(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            mark(directory, trainer.global_rank, trainer.global_step)

    strategy = PoplarStrategy(zero_stage=2, plan=toy.plan_of(*ROWS), timeout_s=timeout_s)
    trainer = jobs.trainer_for(strategy, STEPS, devices=2, callbacks=[Marks()])
    trainer.fit(jobs.ToyModule(), torch.utils.data.DataLoader(jobs.TokenData(), shuffle=False))


def hf(directory: Path, timeout_s: float) -> None:
    from transformers import TrainerCallback

    from poplar.integrations.hf import PoplarTrainer
    from tests import toy
    from tests.integrations import hf_jobs as jobs

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
            mark(directory, int(os.environ["RANK"]), state.global_step)

    args = jobs.arguments(str(directory / "out"), STEPS, logging_steps=1000, disable_tqdm=True)
    trainer = PoplarTrainer(model=jobs.tiny_gpt2(), args=args, train_dataset=jobs.LabelledTokens(),
                            plan=toy.plan_of(*ROWS), zero_stage=2, collective_timeout_s=timeout_s,
                            callbacks=[Marks()])
    trainer.train()


if __name__ == "__main__":
    torch.set_num_threads(1)
    door, directory, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    (directory / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    {"lightning": lightning, "hf": hf}[door](directory, timeout)
