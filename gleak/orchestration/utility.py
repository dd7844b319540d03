"""Utility: the test accuracy of federated training under each defense of a suite, against the same training without it.

    [utility]                    keys of gleak.contracts.config.UtilityConfig
    dataset = "fashion-mnist"    Debian's copy by default; mnist / cifar10 / folder:PATH where a local copy exists
    model = "mlp"
    algorithm = "fedsgd"         or "fedavg" with local_steps
    clients = 10
    training_rounds = 1000      ("rounds", its first spelling, is accepted)

The loop (`federated_training`, in gleak.mechanics.protocol: the Protocol's default `train_utility`): the train split is shuffled once and dealt into `clients` equal IID shards. Each
round every client draws its batch uniformly without replacement from its own shard (batch_size samples, or
batch_size x local_steps for FedAvg), computes its update through its defense's `client_gradient` hook (FedSGD: one
gradient; FedAvg: local_steps SGD steps at lr on consecutive mini-batches, sending w_before - w_after) and sends
`defense.transform(update)`; the server applies the mean of what the clients sent (gleak.mechanics.client_update.server_step:
FedSGD w -= lr * mean gradient; FedAvg w -= mean delta). The rounds run through gleak.mechanics.rounds.run_rounds, the
loop attack trials use. One defense instance per client, reset once, so stateful defenses (error feedback) keep
their state across rounds. The run's protocol (`utility_setup`: fedsgd, fedavg with algorithm = "fedavg", or the
protocol a defense entry names, such as cgd) trains in its `train_utility`; CGD's is its vectorised engine.
Accuracy: top-1 on the whole test split after the last round.

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
import sys
import time
import traceback
from typing import Any, Callable

import torch

from gleak.contracts.config import UtilityConfig
from gleak.contracts.registry import create, plugin_info
from gleak.contracts.seeds import derive_seed, generator
from gleak.mechanics import device as devices
from gleak.mechanics.data import ImageDataset
from gleak.mechanics.modality import modality_of

# The training loop is the Protocol's default `train_utility` (gleak.mechanics.protocol); its names stay importable from here.
from gleak.mechanics.protocol import Protocol
from gleak.mechanics.protocol_setup import Setup
from gleak.mechanics.rounds import CURVE_POINTS, accuracy, federated_training  # noqa: F401

# A run's protocol where a suite's case names one: (name, full params); None: the [utility] table's own algorithm.
Protocolled = tuple[str, dict[str, Any]] | None
# Bump when a change to gleak alters what an existing utility config computes, so that stored runs are not reused.
UTILITY_FORMAT = 1
BASELINE = ("none", {})
# utility.csv: DESIGN.md's contract columns first, then gleak's own.
UTILITY_CSV_COLUMNS = [
    "defense", "defense_params", "dataset", "model", "accuracy", "baseline_accuracy", "epsilon", "seconds",
    "status", "error", "algorithm", "rounds", "clients", "utility_id", "extra",
]  # fmt: skip


def _json(d: Any) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def utility_id(cfg: UtilityConfig, defense: str, params: dict[str, Any], protocol: Protocolled = None) -> str:
    """The key of one run: a hash of everything it computes (training config, defense, defense parameters, and the
    protocol where the suite's case names one: runs without keep the ids they always had)."""
    ident = {"format": UTILITY_FORMAT, "utility": cfg.to_dict(), "defense": defense, "defense_params": params}
    if protocol is not None:
        ident["protocol"] = list(protocol)
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_utility_data(cfg: UtilityConfig) -> tuple[ImageDataset, ImageDataset]:
    """The run's training and test splits, as its data set's modality loads them (gleak.mechanics.modality)."""
    modality = modality_of(cfg)
    return modality.load(cfg, "train"), modality.load(cfg, "test")


def accounting(cfg: UtilityConfig, train_size: int) -> tuple[float, int]:
    """(sampling rate, steps) of one client's data under the run: B / shard size, rounds x local steps."""
    shard = train_size // cfg.clients
    steps = cfg.training_rounds * (cfg.local_steps if cfg.algorithm == "fedavg" else 1)
    return cfg.batch_size / shard, steps


def shards(n: int, clients: int, seed: int) -> list[torch.Tensor]:
    """The train indices shuffled once and dealt into `clients` equal IID shards (the remainder unused)."""
    perm = torch.randperm(n, generator=generator(seed, "utility-shards"))
    size = n // clients
    return [perm[i * size : (i + 1) * size] for i in range(clients)]


def utility_setup(cfg: UtilityConfig, defense: str, params: dict[str, Any], protocol: Protocolled = None) -> Setup:
    """The protocol and client defense of a utility run: the protocol the suite's case names (`protocol`), with the
    defense on every client; a protocol named as a defense ([[defense]] name = "cgd") with no transform; else fedavg
    (algorithm = "fedavg": local_steps at lr on mini-batches of batch_size) or fedsgd, with the defense."""
    if protocol is not None:
        return Setup(protocol[0], dict(protocol[1]), defense, params)
    info = plugin_info("defense", defense)
    fedavg = {"local_steps": cfg.local_steps, "local_lr": cfg.client_step, "local_batch_size": cfg.batch_size}
    if info.protocol is not None:
        own = dict(params)
        if cfg.algorithm == "fedavg" and "local_steps" in plugin_info("protocol", info.protocol).params:
            own.update(fedavg)  # secure aggregation of FedAvg's deltas
        return Setup(info.protocol, own, "none", {})
    if cfg.algorithm == "fedavg":
        return Setup("fedavg", fedavg, defense, params)
    return Setup("fedsgd", {}, defense, params)


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def run_utility(
    cfg: UtilityConfig, defense: str, params: dict[str, Any], on_round: Callable[[], None] | None = None,
    protocol: Protocolled = None, device: str = "cpu",
) -> dict[str, Any]:
    """One utility run as a row for the store. Never raises for a failing run: the row says why.

    The run's protocol trains (`train_utility`: the federated loop through run_rounds, or CGD's engine) and
    returns at least {"accuracy": float}, maybe "epsilon". Epsilon: the result's own, or the client defense's
    `epsilon` for the run's delta, sampling rate and steps. device: resolved (gleak.mechanics.device.resolve), where training
    computes; recorded in the row's extra."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"status": "ok", "error": None, "traceback": None, "accuracy": None, "epsilon": None}
    extra: dict[str, Any] = {"device": device}
    try:
        with torch.random.fork_rng(devices=[]):  # a plugin that touches the global RNG cannot leak into the next run
            torch.manual_seed(derive_seed(cfg.seed, "utility-global"))
            train, test = load_utility_data(cfg)
            setup = utility_setup(cfg, defense, params, protocol)
            protocol: Protocol = create("protocol", setup.protocol, **setup.protocol_params)
            d = create("defense", setup.defense, **setup.defense_params)
            own = type(protocol).train_utility is not Protocol.train_utility
            if own:  # a protocol's own training engine (CGD) keeps its tensors where it made them: on the CPU
                device = extra["device"] = "cpu"
            with devices.use(device):
                result = protocol.train_utility(cfg, train, test, generator(cfg.seed, "utility-protocol"),
                                                defense=(setup.defense, setup.defense_params), on_round=on_round)  # fmt: skip
            if own:
                extra["trained_by"] = "train_utility"
            if "accuracy" not in result:
                raise ValueError(f"protocol {setup.protocol!r}: train_utility returned no 'accuracy'")
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


# ---- storage: table `utility` in the output folder's results.sqlite (gleak.orchestration.store.Store) ------------------------
_META = "utility"  # meta key: {"baseline": id, "members": [id, ...]} of the folder's current suite


def label(defense: str, protocol: Protocolled) -> str:
    """The defense column of a run: 'PROTOCOL+DEFENSE' where the case names a protocol (as the leaderboard ranks it)."""
    return defense if protocol is None else f"{protocol[0]}+{defense}"


def _put(store: Any, uid: str, cfg: UtilityConfig, defense: str, params: dict[str, Any], row: dict[str, Any]) -> None:
    rec = {"utility_id": uid, "defense": defense, "defense_params": _json(params), "dataset": cfg.dataset,
           "model": cfg.model, "config": _json(cfg.to_dict()), **{k: row.get(k) for k in
           ("status", "error", "traceback", "accuracy", "epsilon", "seconds", "extra")}, "finished_at": time.time()}  # fmt: skip
    store.put_utility(rec)


def defense_configs(trials: list[Any]) -> list[tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], Protocolled]]:
    """The distinct (defense, params) of a suite's trials, in suite order; (defense, params, (protocol, params))
    for trials whose case names a protocol (the pair is trained, and ranked, as one defense)."""
    seen: dict[str, Any] = {}
    for t in trials:
        named = t.case.protocol != "fedsgd" or t.case.protocol_params
        proto = (t.case.protocol, t.case.protocol_params) if named else None
        entry = (t.defense, t.defense_params) if proto is None else (t.defense, t.defense_params, proto)
        seen.setdefault(_json(entry), entry)
    return list(seen.values())


def suite_runs(cfg: UtilityConfig, defenses: list[Any]) -> list[tuple[str, str, dict[str, Any], Protocolled]]:
    """(id, defense, params, protocol) of every distinct run a suite needs: the baseline first, then each defense
    config (see defense_configs)."""
    runs, seen = [], set()
    for entry in [BASELINE, *defenses]:
        d, p, proto = entry if len(entry) == 3 else (*entry, None)
        uid = utility_id(cfg, d, p, proto)
        if uid not in seen:
            seen.add(uid)
            runs.append((uid, d, p, proto))
    return runs


def _work(cfg_json: str, defense: str, params: dict[str, Any], protocol: Protocolled = None, device: str = "cpu") -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_utility(UtilityConfig.from_dict(json.loads(cfg_json)), defense, params, protocol=protocol, device=device)


def _result_or_failed(fut: Any) -> dict[str, Any]:
    """A finished utility run's row; a failed row where its worker process died (run_utility itself never raises):
    the runs stored so far stay, the rest of the pool's runs are failed rows that the next run retries."""
    from concurrent.futures.process import BrokenProcessPool

    try:
        return fut.result()
    except BrokenProcessPool:
        why = ("WorkerDied: a utility worker process ended abruptly (out of memory, a signal or os._exit) while this "
               "run was running or waiting; rerun the suite to retry it")  # fmt: skip
        return {"status": "failed", "error": why, "traceback": None, "accuracy": None, "epsilon": None}


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
    cfg: UtilityConfig, defenses: list[tuple[str, dict[str, Any]]], store: Any, progress: bool = True, workers: int = 1,
    device: str = "cpu",
) -> tuple[int, int]:
    """Run every utility run of a suite that the store does not hold as ok (in `workers` processes, one torch thread
    each); each run is committed when it finishes. Returns (runs made, runs failed among the suite's runs)."""
    from tqdm import tqdm

    runs = suite_runs(cfg, defenses)
    members = [utility_id(cfg, *(e if len(e) == 3 else (*e, None))) for e in defenses]
    store.set_meta(_META, {"baseline": runs[0][0], "members": members, "config": cfg.to_dict()})
    done = store.utility_ok_ids()
    todo = [r for r in runs if r[0] not in done]
    bar = tqdm(total=len(todo) * cfg.training_rounds, unit="round", disable=not progress or not todo, dynamic_ncols=True,
               file=sys.stderr, desc="utility")  # fmt: skip
    try:
        if workers <= 1 or len(todo) <= 1:
            with _threads(1):
                for uid, d, p, proto in todo:
                    bar.set_postfix_str(f"{label(d, proto)} {_json(p)}"[:60], refresh=False)
                    start = bar.n
                    row = run_utility(cfg, d, p, on_round=lambda: bar.update(1), protocol=proto, device=device)
                    bar.update(start + cfg.training_rounds - bar.n)  # runs that end early or train themselves
                    _put(store, uid, cfg, label(d, proto), p, row)
        else:
            from concurrent.futures import ProcessPoolExecutor, as_completed

            from gleak.orchestration.fork_server import process_context

            # the trials' fork server (torch imported once), not a fresh interpreter per worker
            with ProcessPoolExecutor(workers, mp_context=process_context()) as pool:
                futs = {pool.submit(_work, _json(cfg.to_dict()), d, p, proto, device): (uid, d, p, proto) for uid, d, p, proto in todo}
                for fut in as_completed(futs):
                    uid, d, p, proto = futs[fut]
                    _put(store, uid, cfg, label(d, proto), p, _result_or_failed(fut))
                    bar.update(cfg.training_rounds)
    finally:
        bar.close()
    ids = [r[0] for r in runs]
    return len(todo), store.utility_failed(ids)


def run_suite_utility(suite: Any, store: Any, progress: bool = True, workers: int = 1, device: str = "cpu") -> int:
    """The [utility] runs of a gleak.orchestration.suite.Suite (none without the table); returns how many of them failed."""
    if suite.utility is None:
        store.set_meta(_META, None)  # a table removed from the suite leaves no stale utility.csv behind
        return 0
    made, failed = run_utilities(suite.utility, defense_configs(suite.trials), store, progress, workers, device)
    print(f"gleak: utility: {made} training runs made, {failed} failed", file=sys.stderr)
    return failed


def utility_config(store: Any) -> UtilityConfig | None:
    """The training config of the folder's current suite, or None without a [utility] table."""
    meta = store.get_meta(_META)
    return UtilityConfig.from_dict(meta["config"]) if meta and "config" in meta else None


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
                    # A protocol that trains itself (CGD) compares with its own centralized run on the same samples.
                    "baseline_accuracy": json.loads(r["extra"] or "{}").get("baseline_accuracy", base_acc),
                    "algorithm": cfg["algorithm"], "rounds": cfg["rounds"],
                    "clients": cfg["clients"], "utility_id": uid})  # fmt: skip
    return pd.DataFrame(out, columns=UTILITY_CSV_COLUMNS)
