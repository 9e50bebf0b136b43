"""One rank of ``PoplarTrainer`` under torchrun: 3 steps of the tiny GPT-2 job at the ZeRO stage in
argv[1], saved under argv[2]; rank 0 writes what ``from_pretrained`` loaded back and the eval loss
to argv[3]."""

import os
import sys

import torch

from tests.integrations import hf_jobs as jobs

if __name__ == "__main__":
    out = jobs.train_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]),
                          int(sys.argv[1]), sys.argv[2], 3)
    if out is not None:
        torch.save({"state": out["state"], "eval_loss": out["eval_loss"]}, sys.argv[3])
