"""Seconds per CGD iteration against the same iteration of centralized training on the same data: the cost of
confinement, measured in one run.

    python benchmarks/cgd_speed.py                      # 6,000 Fashion-MNIST images, the paper's partitions
    python benchmarks/cgd_speed.py --samples 3000 --threads 2

One iteration = every participant's forward and backward pass on all of its local data at its own confined model,
the secure sums (first layer within feature groups, the rest across all) and every participant's step. Centralized
= the same full-batch gradient step on all the data with one model, twice: gleak's engine with one participant, and
plain torch (nn.Sequential + autograd + SGD) as the floor that engine must not lose to. Medians over --repeat
iterations after one warm-up. The ratio CGD / centralized is the cost of confinement. Both run with the heap
setting the engine makes (gleak.mechanics.allocator.retain_freed_memory: freed tensor memory is reused, not returned and
re-faulted), set here before the first measurement so that the floor runs under it too.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gleak.mechanics.allocator import retain_freed_memory  # noqa: E402
from gleak.mechanics.data import load_dataset  # noqa: E402
from gleak.protocols.cgd_training import ConfinedMLP, Partition, init_deltas, make_layout  # noqa: E402


def timed(step, repeat: int) -> float:
    step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--partitions", nargs="*", default=["10x1", "100x1", "1000x1", "10x7", "100x49"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    ds = load_dataset("fashion-mnist", "train")
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(ds), generator=g)[: args.samples]
    x, y = ds.normalized(idx).flatten(1), ds.y[idx]
    sizes = [x.shape[1], 256, 10]

    model = nn.Sequential(nn.Linear(sizes[0], 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def torch_step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    t_torch = timed(torch_step, args.repeat)
    central = ConfinedMLP(make_layout(x, y, Partition(1, 1)), sizes, init_deltas(1, 0.1, None, 0), 0, secure_sum="float")
    t_central = timed(lambda: central.step(0.5), args.repeat)
    print(f"{args.samples} Fashion-MNIST images, MLP 784-256-10, {torch.get_num_threads()} torch thread(s), "
          f"median of {args.repeat} iterations")  # fmt: skip
    print(f"centralized, plain torch:   {t_torch:.4f} s/iteration")
    print(f"centralized, gleak engine:  {t_central:.4f} s/iteration (x{t_central / t_torch:.2f} plain torch)")
    print()
    print("| m | secure sum | s/iteration | / centralized (engine) | / centralized (plain torch) |")
    print("| --- | --- | --- | --- | --- |")
    for p in args.partitions:
        part = Partition.parse(p)
        for mode in ("protocol", "float"):
            net = ConfinedMLP(make_layout(x, y, part), sizes, init_deltas(part.m, 0.1, None, 0), 0, secure_sum=mode)
            t = timed(lambda: net.step(0.5), args.repeat)
            print(f"| ({p}) | {mode} | {t:.4f} | {t / t_central:.2f} | {t / t_torch:.2f} |", flush=True)
            del net
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
