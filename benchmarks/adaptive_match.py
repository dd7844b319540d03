"""Plain against defense-aware (option defense_aware = true) for dlg, inverting-gradients and imprint, defense by defense.

    python benchmarks/adaptive_match.py ATTACK 'ATTACK_PARAMS' 'DEFENSES' SEEDS ['CASE'] [--key psnr|share_psnr40]

ATTACK_PARAMS: a JSON object; DEFENSES: a JSON list of [name, params] pairs; CASE: JSON CaseConfig fields over the
default (skimage, mlp, 8x8). Prints one line per defense: the median, mean and per-seed values of the key over seeds
0..SEEDS-1, plain then defense-aware, and the mean seconds per trial (wall clock, one thread). Issue 13's numbers
(the report of branch adaptive-match) were measured with it, for example:

    python benchmarks/adaptive_match.py inverting-gradients '{"iterations": 300, "tv": 1e-4}' \
        '[["topk", {"ratio": 0.9}], ["dgp", {}]]' 3
    python benchmarks/adaptive_match.py imprint '{"bins": 64, "gain": 1e6}' '[["dgp", {}]]' 3 \
        '{"resolution": null, "batch_size": 32, "rounds": 4, "server_lr": 0.01}' --key share_psnr40
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's gleak

import torch  # noqa: E402

from gleak.contracts.config import CaseConfig, TrialConfig  # noqa: E402
from gleak.orchestration.trial import execute  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("attack")
    ap.add_argument("attack_params")
    ap.add_argument("defenses")
    ap.add_argument("seeds", type=int)
    ap.add_argument("case", nargs="?", default="{}")
    ap.add_argument("--key", default="psnr", choices=("psnr", "share_psnr40"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    case = CaseConfig.from_dict({"dataset": "skimage", "model": "mlp", "resolution": 8, **json.loads(a.case)})
    params = json.loads(a.attack_params)
    for name, dparams in json.loads(a.defenses):
        line = [f"{name} {json.dumps(dparams)}"]
        for aware in (False, True):
            values, seconds = [], []
            for seed in range(a.seeds):
                t0 = time.perf_counter()
                row = execute(TrialConfig("t", a.attack, {**params, "defense_aware": aware}, name, dparams, case, seed))
                seconds.append(time.perf_counter() - t0)
                values.append(round(row[a.key] if a.key == "psnr" else row["extra"][a.key], 3))
            line.append(f"{'aware' if aware else 'plain'}: median {statistics.median(values):g} mean "
                        f"{statistics.mean(values):.3g} {values} ({statistics.mean(seconds):.2f} s/trial)")  # fmt: skip
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
