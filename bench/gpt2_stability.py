"""Is the GPT-2 example (docs/checkpoints.md) stable in one process, whatever the micro-batch?

The example (a 2-layer GPT-2 from ``gpt2-config.json``, dropout 0.1, the shipped
corpus packed in blocks of 64 byte-level tokens, global batch 32, AdamW with weight decay 0.01,
gradient clipping 1.0, ``WarmupCosineLR`` over 300 iterations) trained by plain torch in one
process on the whole global batch, cut into micro-batches of ``b`` samples (32 / b accumulated
micro-steps). Each micro-batch draws its own dropout masks, so the split changes the run as a
multi-rank plan does; the global batch of each iteration is the one Poplar's loader takes
(``GlobalBatchSampler`` with the config's seed), and the model starts from the same weights.

A spike: iteration k's loss divided by the median of its neighbours, the up to 5 iterations
before it and the up to 5 after it (fewer at the ends of the run; iteration 0, the untrained
loss, has none before it and is not counted). The example is stable when no iteration's ratio
exceeds 1.5. ``check_losses`` is the same test applied to a run's ``metrics.json``.

Prints one row per micro-batch (the largest ratio, where, the largest gradient norm before
clipping, the last loss) and a last line ``RESULT {json}``.

    python bench/gpt2_stability.py [--lr 0.003] [--warmup 5] [--micro-batches 2 4 8 32]
    python bench/gpt2_stability.py --metrics runs/gpt2c/metrics.json   # check a run's losses
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"model_type": "gpt2", "vocab_size": 260, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4,
         "bos_token_id": 257, "eos_token_id": 258}
WINDOW = 5  # neighbours each side
LIMIT = 1.5  # a ratio above it is a spike


def run_config(model_path: str, lr: float, warmup: int, iterations: int) -> dict:
    """gpt2-run.json of docs/checkpoints.md with this lr and warm-up (the corpus shipped with Poplar)."""
    from poplar.workloads.text import default_corpus_path

    return {"train_batch_size": 32, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": warmup,
                                                               "total_num_steps": iterations,
                                                               "warmup_type": "linear"}},
            "poplar": {"iterations": iterations, "model": {"hf_config": model_path},
                       "data": {"path": str(default_corpus_path()), "seq_len": 64}}}


def spike_ratios(losses: list[float]) -> list[float]:
    """Per iteration, its loss over the median of its neighbours (see the module doc); 0 for
    iteration 0."""
    out = [0.0]
    for k in range(1, len(losses)):
        around = losses[max(0, k - WINDOW):k] + losses[k + 1:k + 1 + WINDOW]
        out.append(losses[k] / statistics.median(around) if around else 0.0)
    return out


def train(raw: dict, micro_batch: int) -> tuple[list[float], list[float], float]:
    """(losses, gradient norms before clipping, seconds) of one process at ``micro_batch``."""
    import torch
    from torch.utils.data import default_collate

    from poplar.train.run_parts import build_parts
    from poplar.train.config import TrainConfig
    from poplar.train.data import GlobalBatchSampler
    from poplar.train.schedule import apply_lr

    cfg = TrainConfig.from_dict(raw)
    torch.manual_seed(cfg.seed)  # as ``poplar train`` does before it builds the model
    parts = build_parts(cfg, torch.device("cpu"))
    model, optimizer, loss_fn, data = parts.model, parts.optimizer, parts.loss_fn, parts.train_data
    gbs, schedule = cfg.global_batch_size(1), cfg.lr_schedule()
    if gbs % micro_batch:
        raise SystemExit(f"micro-batch {micro_batch} does not divide the global batch {gbs}")
    sampler = GlobalBatchSampler(len(data), gbs, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    losses, norms, t0 = [], [], time.perf_counter()
    for k in range(cfg.iterations):
        apply_lr(optimizer, schedule(k))
        idx = sampler.indices(k)
        optimizer.zero_grad(set_to_none=True)
        sums, count = 0.0, 0
        micro = [default_collate([data[i] for i in idx[s:s + micro_batch]]) for s in range(0, gbs, micro_batch)]
        total = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)  # tokens scored this iteration
        for m in micro:
            loss_sum, n = loss_fn(model, m)
            (loss_sum / total).backward()  # the token-weighted mean over the whole global batch
            sums, count = sums + float(loss_sum.detach()), count + int(n)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.gradient_clipping)))
        optimizer.step()
        losses.append(sums / count)
    return losses, norms, time.perf_counter() - t0


def summary(losses: list[float], norms: list[float] | None = None) -> dict:
    ratios = spike_ratios(losses)
    at = max(range(len(ratios)), key=ratios.__getitem__)
    return {"max_ratio": round(ratios[at], 4), "at_iteration": at, "loss_there": round(losses[at], 4),
            "spikes": sum(r > LIMIT for r in ratios), "last_loss": round(losses[-1], 4),
            "max_grad_norm": round(max(norms), 4) if norms else None}


def check_metrics(path: str) -> None:
    """The spike test on a run's ``metrics.json`` (its per-iteration losses)."""
    metrics = json.loads(Path(path).read_text())
    records = metrics["iterations"]
    norms = [r["grad_norm"] for r in records if r.get("grad_norm") is not None]
    s = summary([r["loss"] for r in records], norms or None)
    print(f"{path}: {len(records)} iterations, max ratio {s['max_ratio']:.3f} at iteration {s['at_iteration']} "
          f"(loss {s['loss_there']:.4f}), {s['spikes']} above {LIMIT}, last loss {s['last_loss']:.4f}"
          + (f", max grad norm {s['max_grad_norm']:.3f}" if norms else ""))
    print("RESULT " + json.dumps({"metrics": path, **s, "stable": s["spikes"] == 0}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--warmup", type=int, default=30, help="warmup_num_steps (linear)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8, 32])
    parser.add_argument("--metrics", help="check this metrics.json instead of training")
    args = parser.parse_args()
    if args.metrics:
        return check_metrics(args.metrics)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("this bench needs transformers: pip install 'poplar[hf]'")
    import torch

    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / "gpt2-config.json"
        model_path.write_text(json.dumps(MODEL))
        raw = run_config(str(model_path), args.lr, args.warmup, args.iterations)
        print(f"lr {args.lr}, linear warm-up {args.warmup}, {args.iterations} iterations, global batch 32; "
              f"spike = loss > {LIMIT} x the median of the {WINDOW} iterations each side")
        print(f"{'mbs':>4} {'steps':>5} {'max ratio':>9} {'at':>4} {'loss':>7} {'spikes':>6} {'max |g|':>8} "
              f"{'last loss':>9} {'s':>6}")
        for b in args.micro_batches:
            losses, norms, seconds = train(raw, b)
            s = summary(losses, norms)
            rows[b] = {**s, "seconds": round(seconds, 1)}
            print(f"{b:>4} {32 // b:>5} {s['max_ratio']:>9.3f} {s['at_iteration']:>4} {s['loss_there']:>7.4f} "
                  f"{s['spikes']:>6} {s['max_grad_norm']:>8.3f} {s['last_loss']:>9.4f} {seconds:>6.1f}", flush=True)
    stable = all(r["spikes"] == 0 for r in rows.values())
    print("RESULT " + json.dumps({"lr": args.lr, "warmup": args.warmup, "iterations": args.iterations,
                                  "limit": LIMIT, "window": WINDOW, "stable": stable, "micro_batches": rows}))


if __name__ == "__main__":
    main()
