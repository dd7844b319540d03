"""How the defense-aware closed form's gain under noise grows with the first layer's width (issue 13).

The pooled estimate (attacks/closed_form.py, `defense_aware = true`) averages the noise over every row of the first
layer: its error is the noise over the bias-gradient energy of all rows, the plain closed form's over the largest
row's alone, so the gain grows with the layer's width. This sweeps the MLP's width at a few noise scales (skimage,
batch 1, seeds 0-4) and prints, per (sigma, width), the median PSNR and the share of trials recovered (margin
verdict) for the plain closed form and the defense-aware one. (In absolute terms both fall with the width here:
PyTorch's default init scales the next layer by 1/sqrt(width), so the bias gradients' total energy stays put.)

    OMP_NUM_THREADS=1 python benchmarks/adaptive_closed_form.py > benchmarks/adaptive_closed_form.txt
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gleak.contracts.config import CaseConfig, TrialConfig  # noqa: E402
from gleak.orchestration.trial import execute  # noqa: E402

SIGMAS = (1e-2, 3e-2, 1e-1)
WIDTHS = (64, 256, 1024, 4096)
SEEDS = range(5)


def main() -> None:
    start = time.time()
    print("sigma | width | plain PSNR (median) | plain recovered | aware PSNR (median) | aware recovered")
    for sigma in SIGMAS:
        for width in WIDTHS:
            case = CaseConfig(dataset="skimage", model="mlp", model_params={"hidden": [width]})
            cells = []
            for params in ({}, {"defense_aware": True}):
                runs = [execute(TrialConfig("sweep", "closed-form", params, "noise", {"sigma": sigma}, case, s)) for s in SEEDS]
                psnr = statistics.median(r["psnr"] for r in runs)
                share = sum(r["verdict"] == "recovered" for r in runs) / len(runs)
                cells += [f"{psnr:.1f}", f"{share:.0%}"]
            print(f"{sigma:g} | {width} | " + " | ".join(cells), flush=True)
    print(f"# {len(SIGMAS) * len(WIDTHS) * len(SEEDS) * 2} trials in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
