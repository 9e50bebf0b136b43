"""One rank of ``PoplarStrategy`` under torchrun (the strategy joins the job itself): fit 3 steps of the
toy job at the ZeRO stage in argv[1] and, on rank 0, save the full state to argv[2]."""

import sys

import torch

from tests.integrations import lightning_jobs as jobs

if __name__ == "__main__":
    torch.set_num_threads(1)
    from poplar.integrations.lightning import PoplarStrategy
    from tests import toy

    strategy = PoplarStrategy(zero_stage=int(sys.argv[1]), plan=toy.plan_of(*jobs.PLAN_ROWS))
    trainer = jobs.trainer_for(strategy, 3, devices=3)
    trainer.fit(jobs.ToyModule(), torch.utils.data.DataLoader(jobs.TokenData(), shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:
        torch.save(state, sys.argv[2])
    strategy.engine.close()
