"""How fast gleak's optimisation attacks run against the floor of the same computation written by hand in raw torch.

    python benchmarks/attack_speed.py [--threads 1] [--repeats 5] [--skip-rss] [--device auto|cpu|cuda[:N]]

Prints, measured in this run:
1. ms per iteration of gleak's inverting-gradients (one signed-Adam step) and dlg (one L-BFGS closure evaluation) on
   LeNet and ResNet-18 (CIFAR stem) at batch size 1, 32x32 real images, next to a raw-torch loop written here
   (forward, gradient with create_graph, distance, backward to the image, optimiser step, as the released codes do),
   and their ratio (target <= 1.15 on every line). Per iteration is marginal: the time of 2n iterations minus that
   of n, over n, so per-trial set-up is not counted on either side. Each run is timed `repeats` times, interleaved,
   and the fastest counts (the machine is shared: the minimum is the least disturbed measurement).
2. Restarts of inverting-gradients as one torch.func.vmap computation against the same restarts one after another
   (batch_restarts = "vmap" vs "loop"), and which one batch_restarts = "auto" picks.
3. Peak RSS of one inverting-gradients trial on ResNet-18 at batch size 8 in a fresh process (target < 4 GiB).
   Peak memory does not grow with iterations (each iteration frees its graph), so a few iterations measure it.
Clock: CPU time of this process when --threads is 1 (stable under other load), wall time otherwise; on a GPU
(--device cuda), wall time after torch.cuda.synchronize (the kernels are asynchronous). The model, the batch and the
attacks run on --device (gleak.device.use; default cpu).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gleak  # noqa: E402
from gleak import device as devices  # noqa: E402
from gleak.config import derive_seed  # noqa: E402
from gleak.data import load_dataset  # noqa: E402
from gleak.models import create_model  # noqa: E402
from gleak.protocol import fedsgd_update  # noqa: E402
from gleak.threat import ClientBatch, Knowledge, Observation  # noqa: E402

TARGET_RATIO = 1.15
RSS_TARGET_GIB = 4.0


def observation(model_name: str, batch_size: int, mode: str = "eval") -> tuple[Observation, ClientBatch]:
    ds = load_dataset("skimage")
    idx = torch.arange(batch_size) * 17 % len(ds)
    batch = ClientBatch(ds.normalized(idx), ds.y[idx], ds.mean, ds.std)
    model = create_model(model_name, ds.input_shape, ds.num_classes, seed=derive_seed(0, "model"))
    model.train(mode == "train")
    model = devices.to_device(model)  # the device of the run (main's gleak.device.use)
    batch = ClientBatch(devices.to_device(batch.x), devices.to_device(batch.y), batch.mean, batch.std)
    k = Knowledge(ds.input_shape, ds.num_classes, batch_size=batch_size, mean=ds.mean, std=ds.std)
    return Observation(fedsgd_update(model, batch), k, copy.deepcopy(model)), batch


# ---- the raw-torch floors: what one would write by hand, following the released codes -----------------------------
def raw_inverting_gradients(obs: Observation, y: torch.Tensor, iterations: int, tv: float, seed: int) -> torch.Tensor:
    model = copy.deepcopy(obs.model)
    params = list(model.parameters())
    target = [t for t in obs.update]
    target_norm = torch.stack([t.pow(2).sum() for t in target]).sum().sqrt()
    k = obs.knowledge
    lo, hi = (-k.mean / k.std).view(-1, 1, 1), ((1 - k.mean) / k.std).view(-1, 1, 1)
    x = torch.randn((k.batch_size, *k.input_shape), generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [iterations * 3 // 8, iterations * 5 // 8, iterations * 7 // 8], 0.1)
    for _ in range(iterations):
        opt.zero_grad()
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
        dot = sum((g * t).sum() for g, t in zip(grads, target))
        norm = sum(g.pow(2).sum() for g in grads).sqrt()
        loss = 1 - dot / (norm * target_norm)
        loss = loss + tv * ((x[..., :, 1:] - x[..., :, :-1]).abs().mean() + (x[..., 1:, :] - x[..., :-1, :]).abs().mean())
        # With respect to the image only, as gleak and breaching do: .backward() would also back-propagate into
        # every model parameter, work the attack never uses (a floor that does it flatters gleak).
        (x.grad,) = torch.autograd.grad(loss, [x])
        x.grad.sign_()
        opt.step()
        sched.step()
        with torch.no_grad():
            x.data = torch.max(torch.min(x, hi), lo)
    return x.detach()


def raw_dlg(obs: Observation, steps: int, max_iter: int, seed: int) -> tuple[torch.Tensor, int]:
    model = copy.deepcopy(obs.model)
    params = list(model.parameters())
    target = [t for t in obs.update]
    k = obs.knowledge
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((k.batch_size, *k.input_shape), generator=gen).requires_grad_(True)
    label = torch.randn((k.batch_size, k.num_classes), generator=gen).requires_grad_(True)
    opt = torch.optim.LBFGS([x, label], lr=1, history_size=100, max_iter=max_iter)
    evals = 0

    def closure():
        nonlocal evals
        evals += 1
        opt.zero_grad()
        out = model(x)
        loss = torch.mean(torch.sum(-torch.softmax(label, -1) * F.log_softmax(out, -1), 1))
        grads = torch.autograd.grad(loss, params, create_graph=True)
        dist = sum(((g - t) ** 2).sum() for g, t in zip(grads, target))
        x.grad, label.grad = torch.autograd.grad(dist, [x, label])  # the dummies only, as gleak (see above)
        return dist

    for _ in range(steps):
        opt.step(closure)
    return x.detach(), evals


# ---- timing ----------------------------------------------------------------------------------------------------------
def clock(threads: int):
    return time.process_time if threads == 1 else time.perf_counter


def fastest(fns: dict[str, callable], repeats: int, now) -> dict[str, tuple[float, object]]:
    """Run each function `repeats` times, interleaved; keep each one's fastest time and its last result."""
    best: dict[str, tuple[float, object]] = {}
    for fn in fns.values():  # warm-up, not timed: first calls pay for lazy initialisation
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = now()
            out = fn()
            dt = now() - t0
            if name not in best or dt < best[name][0]:
                best[name] = (dt, out)
    return best


def marginal(fns: dict[str, callable], n: int, repeats: int, now) -> dict[str, float]:
    """Seconds per iteration of each side: (time of 2n iterations - time of n) / (their difference in iterations),
    so that per-trial set-up (copying the model, labels, final scoring) does not count as iteration time. Each fn
    takes a run length and returns how many iterations (or closure evaluations) it did."""
    runs = {f"{name}@{k}": (lambda fn=fn, k=k: fn(k * n)) for name, fn in fns.items() for k in (1, 2)}
    best = fastest(runs, repeats, now)
    return {name: (best[f"{name}@2"][0] - best[f"{name}@1"][0]) / (best[f"{name}@2"][1] - best[f"{name}@1"][1])
            for name in fns}  # fmt: skip


def speed_lines(args, now) -> list[tuple[str, float, float]]:
    lines = []
    plan = [("lenet", args.lenet_iterations, args.lenet_lbfgs_steps, 20), ("resnet18", args.resnet_iterations, 1, 10)]
    for model_name, its, steps, max_iter in plan:
        obs, batch = observation(model_name, 1)

        def gleak_ig(n):
            gleak.create("attack", "inverting-gradients", preset="code", iterations=n).reconstruct(obs, torch.Generator().manual_seed(0))
            return n

        def raw_ig(n):
            raw_inverting_gradients(obs, batch.y, n, 0.1, 0)
            return n

        def gleak_dlg(n):
            atk = gleak.create("attack", "dlg", iterations=n, max_iter=max_iter)
            return atk.reconstruct(obs, torch.Generator().manual_seed(0)).extra["evaluations"]

        def raw_dlg_(n):
            return raw_dlg(obs, n, max_iter, 0)[1]

        r = marginal({"gleak": gleak_ig, "raw": raw_ig}, its, args.repeats, now)
        lines.append((f"inverting-gradients {model_name:<8} B=1", 1e3 * r["gleak"], 1e3 * r["raw"]))
        r = marginal({"gleak": gleak_dlg, "raw": raw_dlg_}, steps, args.repeats, now)
        lines.append((f"dlg (per L-BFGS evaluation) {model_name:<8} B=1", 1e3 * r["gleak"], 1e3 * r["raw"]))
        print(f"  measured {model_name}", file=sys.stderr, flush=True)
    return lines


def restart_lines(args, now) -> list[str]:
    out = []
    from gleak.attacks._gradmatch import attack_model

    for model_name, batch_size, restarts, its in (("lenet", 1, 8, args.lenet_iterations), ("lenet", 8, 4, args.lenet_iterations // 2),
                                                  ("resnet18", 1, 4, 2)):  # fmt: skip
        obs, _ = observation(model_name, batch_size)
        t = {}
        for mode in ("vmap", "loop"):
            atk = gleak.create("attack", "inverting-gradients", preset="code", iterations=its, restarts=restarts, batch_restarts=mode)
            t[mode] = fastest({mode: lambda: atk.reconstruct(obs, torch.Generator().manual_seed(0))}, args.repeats, now)[mode][0]
        auto = gleak.create("attack", "inverting-gradients", restarts=restarts)
        model, _, params = attack_model(obs)
        picks = "vmap" if auto._use_vmap(model, params) else "loop"
        out.append(
            f"{model_name:<8} B={batch_size} restarts={restarts}: vmap {1e3 * t['vmap'] / its:8.1f} ms/it, one after another "
            f"{1e3 * t['loop'] / its:8.1f} ms/it, speed-up x{t['loop'] / t['vmap']:.2f}; auto picks {picks}"
        )
        print(f"  measured restarts {model_name} B={batch_size}", file=sys.stderr, flush=True)
    return out


RSS_CHILD = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads({threads})
from gleak.config import CaseConfig, TrialConfig
from gleak.trial import execute
case = CaseConfig(dataset="skimage", model="resnet18", batch_size=8, model_mode="eval")
cfg = TrialConfig("bench", "inverting-gradients", {{"preset": "code", "iterations": {its}, "labels": "given"}}, "none", {{}}, case, 0)
t0 = time.perf_counter()
s = execute(cfg, device={device!r})
print(json.dumps({{"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds": time.perf_counter() - t0,
                  "psnr": s["psnr"]}}))
"""


def peak_rss(args) -> dict:
    code = RSS_CHILD.format(root=str(ROOT), threads=args.threads, its=args.rss_iterations, device=args.device)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lenet-iterations", type=int, default=200)
    p.add_argument("--lenet-lbfgs-steps", type=int, default=10)
    p.add_argument("--resnet-iterations", type=int, default=5)
    p.add_argument("--rss-iterations", type=int, default=3)
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default cpu)")
    args = p.parse_args()
    from gleak.errors import InputError

    try:
        args.device = devices.resolve(args.device)
    except InputError as exc:
        print(f"attack_speed: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    now = clock(args.threads)
    if args.device != "cpu":
        now = lambda: (torch.cuda.synchronize(), time.perf_counter())[1]  # noqa: E731
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {args.device}, clock: "
          f"{'CPU time' if args.threads == 1 and args.device == 'cpu' else 'wall'}, best of {args.repeats}")  # fmt: skip
    with devices.use(args.device):
        return _measure(args, now)


def _measure(args, now) -> int:

    print("\n## ms per iteration: gleak vs the raw-torch floor (target ratio <= 1.15)")
    worst = 0.0
    for name, g, r in speed_lines(args, now):
        ratio = g / r
        worst = max(worst, ratio)
        print(f"{name:<48} gleak {g:9.2f} ms   raw {r:9.2f} ms   ratio {ratio:5.2f}  {'ok' if ratio <= TARGET_RATIO else 'OVER'}")
    print(f"worst ratio {worst:.2f} ({'meets' if worst <= TARGET_RATIO else 'misses'} the {TARGET_RATIO} target)")

    print("\n## restarts batched with torch.func.vmap vs one after another (same mathematics)")
    for line in restart_lines(args, now):
        print(line)

    if not args.skip_rss:
        print("\n## peak memory of one inverting-gradients trial, ResNet-18, batch size 8, 32x32 (fresh process)")
        m = peak_rss(args)
        gib = m["maxrss_kib"] / 2**20
        print(f"peak RSS {gib:.2f} GiB ({m['maxrss_kib']} KiB), {args.rss_iterations} iterations in {m['seconds']:.1f} s: "
              f"{'under' if gib < RSS_TARGET_GIB else 'OVER'} the {RSS_TARGET_GIB} GiB target")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
