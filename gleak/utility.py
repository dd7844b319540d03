"""Utility: the test accuracy of federated training under each defense of a suite, against the same training without it.

    [utility]                    keys of gleak.config.UtilityConfig
    dataset = "fashion-mnist"    Debian's copy by default; mnist / cifar10 / folder:PATH where a local copy exists
    model = "mlp"
    algorithm = "fedsgd"         or "fedavg" with local_steps
    clients = 10
    rounds = 1000

The loop (`federated_training`): the train split is shuffled once and dealt into `clients` equal IID shards. Each
round every client draws its batch uniformly without replacement from its own shard (batch_size samples, or
batch_size x local_steps for FedAvg), computes its update through its defense's `client_gradient` hook (FedSGD: one
gradient; FedAvg: local_steps SGD steps at lr on consecutive mini-batches, sending w_before - w_after) and sends
`defense.transform(update)`; the server applies the mean of what the clients sent (gleak.protocol.server_step:
FedSGD w -= lr * mean gradient; FedAvg w -= mean delta). One defense instance per client, reset once, so stateful defenses (error feedback) keep their state
across rounds. A protocol defense that replaces federated training altogether (CGD) trains in its own
`train_utility` and the loop is not used. Accuracy: top-1 on the whole test split after the last round.

Determinism: the model, the data stream and the defenses' randomness each come from a generator derived from the
config's seed, so the undefended baseline sees exactly the same batches as every defended run: the gap in accuracy is
the defense's alone. Epsilon, where a defense defines one, is for the run's delta, its sampling rate (batch size /
shard size) and its steps (rounds x local steps), from the defense's `epsilon` (opacus' accountant for DP noise).

Storage: one row per run in the output folder's results.sqlite (table `utility`), keyed by a hash of the training
config and the defense config, committed when the run finishes; a rerun skips runs stored as ok. The baseline (defense
'none') is one run per training config, shared by every defense of the suite.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import traceback
from typing import Any, Callable

import torch

from gleak.config import UtilityConfig, derive_seed, generator
from gleak.data import ImageDataset, load_dataset
from gleak.models import create_model
from gleak.plugin import Defense
from gleak.protocol import fedavg_update, fedsgd_update, server_step, transmit
from gleak.registry import create
from gleak.threat import ClientBatch

# Bump when a change to gleak alters what an existing utility config computes, so that stored runs are not reused.
UTILITY_FORMAT = 1
BASELINE = ("none", {})
# utility.csv: DESIGN.md's contract columns first, then gleak's own.
UTILITY_CSV_COLUMNS = [
    "defense", "defense_params", "dataset", "model", "accuracy", "baseline_accuracy", "epsilon", "seconds",
    "status", "error", "algorithm", "rounds", "clients", "utility_id", "extra",
]  # fmt: skip
CURVE_POINTS = 10  # test accuracy is also recorded at this many evenly spaced rounds (the learning curve in `extra`)


def _json(d: Any) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def utility_id(cfg: UtilityConfig, defense: str, params: dict[str, Any]) -> str:
    """The key of one run: a hash of everything it computes (training config, defense, defense parameters)."""
    blob = json.dumps(
        {"format": UTILITY_FORMAT, "utility": cfg.to_dict(), "defense": defense, "defense_params": params},
        sort_keys=True, separators=(",", ":"), default=str,
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_utility_data(cfg: UtilityConfig) -> tuple[ImageDataset, ImageDataset]:
    kw = dict(root=cfg.data_root, resolution=cfg.resolution, channels=cfg.channels, download=cfg.download)
    return load_dataset(cfg.dataset, "train", **kw), load_dataset(cfg.dataset, "test", **kw)


def accounting(cfg: UtilityConfig, train_size: int) -> tuple[float, int]:
    """(sampling rate, steps) of one client's data under the run: B / shard size, rounds x local steps."""
    shard = train_size // cfg.clients
    steps = cfg.rounds * (cfg.local_steps if cfg.algorithm == "fedavg" else 1)
    return cfg.batch_size / shard, steps


def shards(n: int, clients: int, seed: int) -> list[torch.Tensor]:
    """The train indices shuffled once and dealt into `clients` equal IID shards (the remainder unused)."""
    perm = torch.randperm(n, generator=generator(seed, "utility-shards"))
    size = n // clients
    return [perm[i * size : (i + 1) * size] for i in range(clients)]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> float:
    was = model.training
    model.eval()
    right = sum(int((model(x[i : i + chunk]).argmax(1) == y[i : i + chunk]).sum()) for i in range(0, len(y), chunk))
    model.train(was)
    return right / len(y)


def federated_training(
    cfg: UtilityConfig, defense: str, params: dict[str, Any], train: ImageDataset, test: ImageDataset,
    on_round: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train under `defense` on every client's update for cfg.rounds rounds; {"accuracy", "curve"}."""
    dtype = torch.float32
    model = create_model(cfg.model, train.input_shape, train.num_classes, seed=derive_seed(cfg.seed, "utility-model"),
                         dtype=dtype, **cfg.model_params)  # fmt: skip
    defenses: list[Defense] = [create("defense", defense, **params) for _ in range(cfg.clients)]
    for d in defenses:
        d.reset()
    x, y = train.normalized().to(dtype), train.y
    xt, yt = test.normalized().to(dtype), test.y
    parts = shards(len(train), cfg.clients, cfg.seed)
    data_rng = generator(cfg.seed, "utility-data")  # the same stream for every defense: paired comparison
    defense_rng = generator(cfg.seed, "utility-defense")
    client_rngs = [generator(cfg.seed, f"utility-client/{i}") for i in range(cfg.clients)]
    fedavg = cfg.algorithm == "fedavg"
    per_round = cfg.batch_size * (cfg.local_steps if fedavg else 1)
    marks = {math.ceil(cfg.rounds * k / CURVE_POINTS) for k in range(1, CURVE_POINTS + 1)}
    curve = []
    for r in range(1, cfg.rounds + 1):
        updates = []
        for i, (d, part) in enumerate(zip(defenses, parts)):
            idx = part[torch.randperm(len(part), generator=data_rng)[:per_round]]
            batch = ClientBatch(x[idx], y[idx], train.mean, train.std)
            if fedavg:
                updates.append(fedavg_update(model, batch, cfg.lr, cfg.local_steps, cfg.batch_size, d, client_rngs[i]))
            else:
                updates.append(fedsgd_update(model, batch, d, client_rngs[i]))
        model = server_step(model, transmit(defenses, updates, defense_rng, f"round {r}: "), cfg.lr)
        if r in marks:
            curve.append([r, accuracy(model, xt, yt)])
        if on_round is not None:
            on_round()
    return {"accuracy": curve[-1][1], "curve": curve}


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def run_utility(
    cfg: UtilityConfig, defense: str, params: dict[str, Any], on_round: Callable[[], None] | None = None
) -> dict[str, Any]:
    """One utility run as a row for the store. Never raises for a failing run: the row says why.

    The defense's `train_utility` is asked first (a protocol such as CGD trains itself and returns at least
    {"accuracy": float}, maybe "epsilon"); None means the standard federated loop. Epsilon: the result's own, or
    the defense's `epsilon` for the run's delta, sampling rate and steps."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"status": "ok", "error": None, "traceback": None, "accuracy": None, "epsilon": None}
    extra: dict[str, Any] = {}
    try:
        with torch.random.fork_rng(devices=[]):  # a plugin that touches the global RNG cannot leak into the next run
            torch.manual_seed(derive_seed(cfg.seed, "utility-global"))
            train, test = load_utility_data(cfg)
            d = create("defense", defense, **params)
            result = d.train_utility(cfg, train, test, generator(cfg.seed, "utility-protocol"))
            if result is None:
                result = federated_training(cfg, defense, params, train, test, on_round)
            else:
                extra["trained_by"] = "train_utility"
            if "accuracy" not in result:
                raise ValueError(f"defense {defense!r}: train_utility returned no 'accuracy'")
            q, steps = accounting(cfg, len(train))
            eps = result["epsilon"] if "epsilon" in result else d.epsilon(delta=cfg.delta, sample_rate=q, steps=steps)
        row["accuracy"] = float(result["accuracy"])
        row["epsilon"] = float(eps) if eps is not None else None
        extra.update({k: v for k, v in result.items() if k not in ("accuracy", "epsilon")})
        if row["epsilon"] is not None:
            extra.update(delta=cfg.delta, sample_rate=q, steps=steps)
    except Exception as exc:  # noqa: BLE001 - a failing run is data, not a crash
        row.update(status="failed", error=_one_line(exc), traceback=traceback.format_exc(limit=8))
    row["extra"] = _json(extra)
    row["seconds"] = time.perf_counter() - t0
    return row


# ---- storage: table `utility` in the output folder's results.sqlite (gleak.store.Store) ------------------------
_META = "utility"  # meta key: {"baseline": id, "members": [id, ...]} of the folder's current suite


def _put(store: Any, uid: str, cfg: UtilityConfig, defense: str, params: dict[str, Any], row: dict[str, Any]) -> None:
    rec = {"utility_id": uid, "defense": defense, "defense_params": _json(params), "dataset": cfg.dataset,
           "model": cfg.model, "config": _json(cfg.to_dict()), **{k: row.get(k) for k in
           ("status", "error", "traceback", "accuracy", "epsilon", "seconds", "extra")}, "finished_at": time.time()}  # fmt: skip
    store.put_utility(rec)


def defense_configs(trials: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """The distinct (defense, params) of a suite's trials, in suite order."""
    seen: dict[str, tuple[str, dict[str, Any]]] = {}
    for t in trials:
        seen.setdefault(f"{t.defense} {_json(t.defense_params)}", (t.defense, t.defense_params))
    return list(seen.values())


def suite_runs(cfg: UtilityConfig, defenses: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, defense, params) of every distinct run a suite needs: the baseline first, then each defense config."""
    runs, seen = [], set()
    for d, p in [BASELINE, *defenses]:
        uid = utility_id(cfg, d, p)
        if uid not in seen:
            seen.add(uid)
            runs.append((uid, d, p))
    return runs


def _work(cfg_json: str, defense: str, params: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_utility(UtilityConfig(**json.loads(cfg_json)), defense, params)


class _threads:
    """Run with n torch threads, then restore: the small models of utility runs lose more to threads fighting over
    shared cores than they gain (measured: 10x slower at 2 threads on a loaded 2-core machine)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.before)


def run_utilities(
    cfg: UtilityConfig, defenses: list[tuple[str, dict[str, Any]]], store: Any, progress: bool = True, workers: int = 1
) -> tuple[int, int]:
    """Run every utility run of a suite that the store does not hold as ok (in `workers` processes, one torch thread
    each); each run is committed when it finishes. Returns (runs made, runs failed among the suite's runs)."""
    from tqdm import tqdm

    runs = suite_runs(cfg, defenses)
    members = [utility_id(cfg, d, p) for d, p in defenses]
    store.set_meta(_META, {"baseline": runs[0][0], "members": members, "config": cfg.to_dict()})
    done = store.utility_ok_ids()
    todo = [r for r in runs if r[0] not in done]
    bar = tqdm(total=len(todo) * cfg.rounds, unit="round", disable=not progress or not todo, dynamic_ncols=True,
               file=sys.stderr, desc="utility")  # fmt: skip
    try:
        if workers <= 1 or len(todo) <= 1:
            with _threads(1):
                for uid, d, p in todo:
                    bar.set_postfix_str(f"{d} {_json(p)}"[:60], refresh=False)
                    start = bar.n
                    row = run_utility(cfg, d, p, on_round=lambda: bar.update(1))
                    bar.update(start + cfg.rounds - bar.n)  # runs that end early or train themselves
                    _put(store, uid, cfg, d, p, row)
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                futs = {pool.submit(_work, _json(cfg.to_dict()), d, p): (uid, d, p) for uid, d, p in todo}
                for fut in as_completed(futs):
                    uid, d, p = futs[fut]
                    _put(store, uid, cfg, d, p, fut.result())
                    bar.update(cfg.rounds)
    finally:
        bar.close()
    ids = [r[0] for r in runs]
    return len(todo), store.utility_failed(ids)


def run_suite_utility(suite: Any, store: Any, progress: bool = True, workers: int = 1) -> int:
    """The [utility] runs of a gleak.suite.Suite (none without the table); returns how many of them failed."""
    if suite.utility is None:
        store.set_meta(_META, None)  # a table removed from the suite leaves no stale utility.csv behind
        return 0
    made, failed = run_utilities(suite.utility, defense_configs(suite.trials), store, progress, workers)
    print(f"gleak: utility: {made} training runs made, {failed} failed", file=sys.stderr)
    return failed


def utility_config(store: Any) -> UtilityConfig | None:
    """The training config of the folder's current suite, or None without a [utility] table."""
    meta = store.get_meta(_META)
    return UtilityConfig(**meta["config"]) if meta and "config" in meta else None


def utility_frame(store: Any):
    """utility.csv of the folder's current suite as a DataFrame (columns UTILITY_CSV_COLUMNS), or None without one."""
    import pandas as pd

    meta = store.get_meta(_META)
    if not meta:
        return None
    rows = {r["utility_id"]: r for r in store.utility_rows()}
    base = rows.get(meta["baseline"])
    base_acc = base["accuracy"] if base is not None and base["status"] == "ok" else None
    out = []
    for uid in meta["members"]:
        r = rows.get(uid)
        if r is None:  # not run yet (an interrupted run): nothing to show
            continue
        cfg = json.loads(r["config"])
        out.append({**{k: r[k] for k in ("defense", "defense_params", "dataset", "model", "accuracy", "epsilon",
                                         "seconds", "status", "error", "extra")},
                    "baseline_accuracy": base_acc, "algorithm": cfg["algorithm"], "rounds": cfg["rounds"],
                    "clients": cfg["clients"], "utility_id": uid})  # fmt: skip
    return pd.DataFrame(out, columns=UTILITY_CSV_COLUMNS)
