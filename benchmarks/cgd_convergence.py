"""Worst and mean confined-model accuracy against the number of iterations T, beside centralized training on the
same samples (same init law and schedule): does the gap of the cgd suite's Table 3 rows close with T?

    python benchmarks/cgd_convergence.py --seed 1 --iterations 1200 --every 100 --partitions 1x1,10x1,10x7

Each partition trains once on the cgd suite's (10x1) training set (6,000 Fashion-MNIST images of a seeded shuffle,
pixels in [0, 1], delta 0.1, alpha 0.5, init_law "interval" (--init-law), the utility_seed's order and inits, exactly as the cgd plugin's utility
runs), and every participant's model is evaluated on the 10,000 test images every --every iterations. "1x1" is the
centralized run. One torch thread. Prints one line per evaluation and a JSON summary at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gleak.contracts.seeds import derive_seed  # noqa: E402
from gleak.mechanics.data import load_dataset  # noqa: E402
from gleak.protocols.cgd_training import INIT_LAWS, ConfinedMLP, Partition, init_deltas, make_layout  # noqa: E402
from gleak.protocols.cgd_utility import features, subset  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="the utility_seed (sample order and inits)")
    ap.add_argument("--iterations", type=int, default=1200)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--partitions", default="1x1,10x1,10x7")
    ap.add_argument("--init-law", default="interval", choices=INIT_LAWS, help="the cgd plugin's init_law")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tr, te = load_dataset("fashion-mnist", "train"), load_dataset("fashion-mnist", "test")
    x, y = subset(tr, args.samples, args.seed, "pixels")
    xt, yt = features(te, slice(None), "pixels"), te.y
    seed = derive_seed(args.seed, "cgd")
    out = {}
    for part in args.partitions.split(","):
        p = Partition.parse(part)
        ss = "float" if p.m == 1 else "protocol"  # as the plugin: centralized sums nothing
        net = ConfinedMLP(make_layout(x, y, p), [x.shape[1], 256, 10], init_deltas(p.m, args.delta, None, seed), seed,
                          mode="cgd", secure_sum=ss, init_law=args.init_law)  # fmt: skip
        who, t0, curve = torch.arange(p.m), time.time(), []
        for k in range(1, args.iterations + 1):
            net.step(args.alpha)
            if k % args.every == 0:
                acc, _ = net.evaluate(xt, yt, who)
                curve.append((k, round(float(acc.min()), 4), round(float(acc.mean()), 4)))
                print(f"({part}) seed {args.seed} T = {k}: worst {curve[-1][1]:.4f} mean {curve[-1][2]:.4f} "
                      f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
        out[part] = curve
    print(json.dumps({"seed": args.seed, "alpha": args.alpha, "delta": args.delta, "init_law": args.init_law,
                      "curves": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
