"""What DGP's error feedback does with the top entries it drops, over the defense-costs utility run.

    nice -n 10 python benchmarks/dgp_error_feedback.py [--rounds 1000] [--top residual|discard|both]

DGP (seed 001) drops, per layer, the top k1 and the bottom k2 of |g_t + e_t|; with error feedback as the paper and its
released code do it (e_{t+1} = p_t - DGP(p_t), "residual"), the dropped top entries go back into the residual, so a
large entry only grows and may never be sent. This script trains the [utility] setting of suites/defense-costs.toml
(MLP, Fashion-MNIST, FedSGD, 10 clients, batch 32, lr 0.1; gleak.orchestration.utility.federated_training, unchanged) with every
client's DGP instrumented, and prints per run:
- the residual's norm (root of the sum over layers of squares, mean over the 10 clients) at a few rounds, next to the
  norm of the gradient the client computed in that round;
- of the entries that were ever in a top-k1 set, the share ever sent (in any round), and the share sent in a round
  after one where they were dropped as top;
- the share of all entries never sent in the whole run;
- the final test accuracy (the undefended baseline of the same run: results/defense-costs/utility.csv, 0.8605).
"discard" is the counterfactual reading (not the paper's, not a gleak option): the dropped top entries are thrown away
and only the bottom entries are fed back, e_{t+1} = p_t * [bottom k2 of |p_t|].
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gleak.contracts.config import UtilityConfig  # noqa: E402
from gleak.contracts.registry import register_defense  # noqa: E402
from gleak.contracts.wire import Update  # noqa: E402
from gleak.defenses.dgp import DGP, dgp_counts  # noqa: E402
from gleak.orchestration.utility import federated_training, load_utility_data  # noqa: E402

PROBES: list["DGPProbe"] = []
MARKS = (1, 10, 100, 300, 1000)


def top_mask(a: torch.Tensor, k1: float, k2: float) -> torch.Tensor:
    """True on the round(k1 n) entries DGP drops from the top (the same stable order as dgp_keep_mask)."""
    n = a.numel()
    top, _ = dgp_counts(n, k1, k2)
    order = torch.sort(a.abs().reshape(-1), descending=True, stable=True).indices
    m = torch.zeros(n, dtype=torch.bool)
    m[order[:top]] = True
    return m.view_as(a)


@register_defense("dgp-probe")
class DGPProbe(DGP):
    """DGP with error feedback, recording what happens to the top entries; top="discard" is the counterfactual."""

    def __init__(self, k1: float = 0.05, k2: float = 0.75, top: str = "residual"):
        super().__init__(k1, k2, error_feedback=True)
        self.top = top
        self.round = 0
        self.ever_top: dict[str, torch.Tensor] = {}
        self.ever_sent: dict[str, torch.Tensor] = {}
        self.sent_after_top: dict[str, torch.Tensor] = {}
        self.norms: dict[int, tuple[float, float]] = {}
        PROBES.append(self)

    def transform(self, update: Update, rng: torch.Generator) -> Update:
        self.round += 1
        res = self._feedback.residual
        corrected = {k: g + res[k] if k in res else g.clone() for k, g in update.tensors.items()}
        sent = super().transform(update, rng)
        for k, p in corrected.items():
            t, s = top_mask(p, self.k1, self.k2), sent[k] != 0
            if k not in self.ever_top:
                self.ever_top[k], self.ever_sent[k], self.sent_after_top[k] = t.clone(), s.clone(), torch.zeros_like(t)
            self.sent_after_top[k] |= s & self.ever_top[k]  # dropped as top in an earlier round, sent now
            self.ever_top[k] |= t
            self.ever_sent[k] |= s
            if self.top == "discard":
                self._feedback.residual[k] = torch.where(t, torch.zeros_like(p), self._feedback.residual[k])
        if self.round in MARKS:
            r = sum(float(v.pow(2).sum()) for v in self._feedback.residual.values()) ** 0.5
            g = sum(float(v.pow(2).sum()) for v in update.tensors.values()) ** 0.5
            self.norms[self.round] = (r, g)
        return sent


def run(rounds: int, top: str) -> None:
    PROBES.clear()
    cfg = UtilityConfig(dataset="fashion-mnist", model="mlp", algorithm="fedsgd", clients=10, training_rounds=rounds, server_lr=0.1,
                        batch_size=32, seed=0)  # fmt: skip  (suites/defense-costs.toml [utility])
    train, test = load_utility_data(cfg)
    t0 = time.process_time()
    result = federated_training(cfg, "dgp-probe", {"top": top}, train, test)
    cpu = time.process_time() - t0

    def total(masks: str, of: str | None = None) -> float:
        num = sum(int(getattr(p, masks)[k].sum()) for p in PROBES for k in getattr(p, masks))
        den = sum(int(getattr(p, of)[k].sum()) if of else getattr(p, masks)[k].numel() for p in PROBES for k in getattr(p, masks))
        return num / den

    ever_top = sum(int(p.ever_top[k].sum()) for p in PROBES for k in p.ever_top)
    top_sent = sum(int((p.ever_top[k] & p.ever_sent[k]).sum()) for p in PROBES for k in p.ever_top)
    never_sent = 1 - total("ever_sent")
    print(f"top = {top!r}: {rounds} rounds, accuracy {result['accuracy']:.4f}, curve {result['curve']}, {cpu:.0f} s CPU")
    for r in MARKS:
        if r <= rounds:
            rn = sum(p.norms[r][0] for p in PROBES) / len(PROBES)
            gn = sum(p.norms[r][1] for p in PROBES) / len(PROBES)
            print(f"  round {r:5d}: residual norm {rn:10.4f}   gradient norm {gn:8.4f}   ratio {rn / gn:9.2f}")
    print(f"  entries ever in a top-k1 set: {total('ever_top'):.4f} of all; of those ever sent: {top_sent / ever_top:.4f};"
          f" sent after being dropped as top: {total('sent_after_top', 'ever_top'):.4f}")
    print(f"  entries never sent in the run: {never_sent:.4f} of all")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--top", choices=["residual", "discard", "both"], default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for top in (("residual", "discard") if args.top == "both" else (args.top,)):
        run(args.rounds, top)
