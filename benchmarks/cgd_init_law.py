"""CGD's two readings of the init law side by side: the worst and mean confined model after T iterations, and its
gap to centralized training on the same samples with the same law (cgd plugin's init_law, seed 000 section 4).

    python benchmarks/cgd_init_law.py --partition 10x1 --seed 0 --laws interval gaussian

"interval" reads w_1 ~ N[-delta, delta] as N(0, 1) truncated to [-1, 1] (times delta), "gaussian" as delta N(0, 1)
untruncated. The training set is the cgd suite's (6,000 Fashion-MNIST images of the utility_seed's shuffle, 2,000
with --samples 2000), pixels in [0, 1], delta 0.1, alpha 0.5, T = 600, as the cgd plugin's utility runs; the sums
are taken in floating point by default (--secure-sum protocol: the Z_2^32 fixed-point sum the suite's (10x1) and
(10x7) rows use; the two differ at rounding level, which full-batch GD at alpha 0.5 amplifies to about a point).
One torch thread. One line per (law, partition) run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gleak.contracts.seeds import derive_seed  # noqa: E402
from gleak.mechanics.data import load_dataset  # noqa: E402
from gleak.protocols.cgd_training import INIT_LAWS, Partition, train  # noqa: E402
from gleak.protocols.cgd_utility import features, subset  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partition", default="10x1")
    ap.add_argument("--seed", type=int, default=0, help="the utility_seed (sample order and inits)")
    ap.add_argument("--laws", nargs="+", default=list(INIT_LAWS), choices=INIT_LAWS)
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--secure-sum", default="float", choices=("float", "protocol"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tr, te = load_dataset("fashion-mnist", "train"), load_dataset("fashion-mnist", "test")
    x, y = subset(tr, args.samples, args.seed, "pixels")
    xt, yt = features(te, slice(None), "pixels"), te.y
    part = Partition.parse(args.partition)
    for law in args.laws:
        common = dict(sizes=[x.shape[1], 256, 10], iterations=args.iterations, alpha=args.alpha, delta=args.delta,
                      seed=derive_seed(args.seed, "cgd"), init_law=law)  # fmt: skip
        t0 = time.time()
        central = train(x, y, xt, yt, partition=Partition(1, 1), secure_sum="float", eval_participants=1, **common)
        run = train(x, y, xt, yt, partition=part, secure_sum=args.secure_sum, **common)
        print(f"init_law {law} ({part}) seed {args.seed} T = {args.iterations} ({args.secure_sum} sums): "
              f"centralized {100 * central.accuracy:.2f}%, worst {100 * run.accuracy:.2f}%, mean "
              f"{100 * run.mean_accuracy:.2f}%, worst - centralized {100 * (run.accuracy - central.accuracy):+.2f} "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
