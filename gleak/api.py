"""The Python API: the command line's work as calls that return objects, for notebooks and scripts.

    import gleak
    r = gleak.run_trial(attack="closed-form", defense={"name": "topk", "ratio": 0.9}, batch_size=4)
    r.metrics["psnr"], r.truth.shape, r.reconstruction.shape
    fig = r.plot()                                  # truth above reconstruction (a matplotlib Figure)

    s = gleak.run("quick", out="/tmp/quick", workers=2)   # a suite: the same store, resume and reports as `gleak run`
    s.rows                                          # its trials as a DataFrame
    df = gleak.results("results/quick")             # any output folder; one column per plugin parameter

Nothing here is a second trial path: `run_trial` expands its arguments with the suite's own expansion (defaults
filled the same way, so the trial id is the one a suite run of the same trial gets) and runs gleak.orchestration.trial.run_trial;
`run` is gleak.orchestration.runner.run_suite.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from gleak.contracts.config import TrialConfig
from gleak.contracts.errors import GleakError, InputError, UnsupportedCase
from gleak.orchestration.store import NOT_APPLICABLE

API_SUITE = "python"  # the suite name of trials run by run_trial (not part of the trial id)


class TrialFailed(GleakError):
    """A trial run through the API failed; `row` is its stored row (error, traceback)."""

    def __init__(self, message: str, row: dict[str, Any]):
        super().__init__(message)
        self.row = row


@dataclass
class TrialResult:
    """One trial: its config, the images (in [0, 1], as the metrics saw them), its metrics and its stored row."""

    config: TrialConfig
    row: dict[str, Any]
    truth: Tensor | None = None  # the victim's batch, (B, C, H, W)
    reconstruction: Tensor | None = None  # what the attack returned (None for label-only attacks)

    @property
    def trial_id(self) -> str:
        return self.config.trial_id

    @property
    def status(self) -> str:
        return self.row["status"]

    @property
    def error(self) -> str | None:
        return self.row.get("error")

    @property
    def metrics(self) -> dict[str, Any]:
        """mse, psnr, rpsnr, ssim, lpips, cosine, iip, feat_mse, label_acc, verdict, matched, grad_dist (None where
        undefined)."""
        keys = ("mse", "psnr", "rpsnr", "ssim", "lpips", "cosine", "iip", "feat_mse", "label_acc", "verdict", "matched",
                "grad_dist")  # fmt: skip
        return {k: self.row.get(k) for k in keys}

    @property
    def extra(self) -> dict[str, Any]:
        """The attack's diagnostics and the model's info (results.csv's `extra`)."""
        return json.loads(self.row.get("extra") or "{}")

    def plot(self, scale: float = 1.2):
        """A matplotlib Figure: the true batch above in its own order, each reconstruction below the image it is
        paired with as the metrics pair them (an empty cell, "none", under an image the attack returned nothing
        for)."""
        from matplotlib.figure import Figure

        from gleak.mechanics.metrics import match, psnr

        if self.truth is None:
            raise InputError(f"trial {self.trial_id} has no images to plot (status {self.status}: {self.error})")
        truth, rec = self.truth, self.reconstruction
        rows: list[tuple[str, list, list]] = [("truth", list(truth), [None] * len(truth))]
        if rec is not None and len(rec):
            under = {int(t): int(r) for t, r in zip(*match(truth, rec))}
            below = [rec[under[i]] if i in under else None for i in range(len(truth))]
            scores = [float(psnr(truth[i : i + 1], rec[under[i] : under[i] + 1])[0]) if i in under else "none"
                      for i in range(len(truth))]  # fmt: skip
            rows.append(("reconstruction", below, scores))
        n = max(len(r[1]) for r in rows)
        fig = Figure(figsize=(scale * n + 0.6, scale * len(rows) + 0.6), layout="constrained")
        axes = fig.subplots(len(rows), n, squeeze=False)
        for i, (label, imgs, psnrs) in enumerate(rows):
            for j in range(n):
                ax = axes[i][j]
                ax.set_xticks([])
                ax.set_yticks([])
                if j >= len(imgs) or imgs[j] is None:
                    ax.set_axis_off()
                    if j < len(imgs):
                        ax.set_title("none", fontsize=8)
                    continue
                a = imgs[j].detach().double().clamp(0, 1).cpu().numpy()
                ax.imshow(a[0] if a.shape[0] == 1 else a[:3].transpose(1, 2, 0), cmap="gray" if a.shape[0] == 1 else None,
                          vmin=0, vmax=1, interpolation="nearest")  # fmt: skip
                if isinstance(psnrs[j], float):
                    ax.set_title(f"{psnrs[j]:.1f} dB", fontsize=8)
            axes[i][0].set_ylabel(label, fontsize=8)
        c = self.config
        fig.suptitle(f"{c.attack} vs {c.defense}, {c.case.dataset}/{c.case.model}/B={c.case.batch_size}, seed {c.seed}",
                     fontsize=9)  # fmt: skip
        return fig

    def __repr__(self) -> str:
        m = self.metrics
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items() if v is not None)
        return f"TrialResult({self.config.attack} vs {self.config.defense}, {self.status}, {shown or self.error})"


def _table(value: Any, kind: str) -> dict[str, Any]:
    """A plugin as a suite table: a name, or a dict with 'name' and parameters."""
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return dict(value)
    raise InputError(f"gleak.run_trial: {kind} must be a name or a dict with 'name' and parameters, got {value!r}")


# -- arguments checked at the call: one InputError naming the argument, never a TypeError from deep inside ---------
MAX_SEED = 2**63  # a trial's seed is stored as SQLite's 64-bit INTEGER (as a suite's seeds are checked)


def _whole(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi); InputError naming the argument otherwise (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value >= hi):
        raise InputError(f"{name} must be " + (f"in [{lo}, 2**63)" if hi == MAX_SEED else f">= {lo}") + f", got {value}")
    return value


def _folder_arg(value: Any, name: str) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, Path)) or not str(value) or "\0" in str(value):
        raise InputError(f"{name} must be a folder's path (str or pathlib.Path), got {value!r}")
    return Path(value)


def _lpips_arg(value: Any, name: str) -> str | None:
    """None, or the path of an AlexNet weights file that torch can read (gleak.mechanics.perceptual.check_lpips_weights)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, Path)):
        raise InputError(f"{name} must be the path of an AlexNet weights file, got {value!r}")
    from gleak.mechanics.perceptual import check_lpips_weights

    check_lpips_weights(str(value), name)
    return str(value)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}")
    return value


def _with_protocol(spec: dict[str, Any], protocol: Any) -> dict[str, Any]:
    """The one place that passes `protocol=` to the suite's expansion: the case's `protocol` and `protocol_params`.
    A protocol with the `none` transform that is also registered as a defense is then spelt as the shipped suites
    spell it by the expansion itself (gleak.orchestration.suite.one_spelling), so that its trials share their ids."""
    if protocol is None:
        return spec
    table = _table(protocol, "protocol")
    name, params = table.pop("name"), table
    case = {**spec["case"], "protocol": name}
    if params:
        case["protocol_params"] = params
    return {**spec, "case": case}


def trial_config(attack: Any, defense: Any = "none", protocol: Any = None, seed: int = 0, **case: Any) -> TrialConfig:
    """The TrialConfig a suite with this one [case], [[attack]] and [[defense]] expands to (defaults filled, values
    validated, the data set checked), so that its trial_id is the suite's. Raises InputError on bad input."""
    from gleak.orchestration import suite as _suite

    _whole(seed, "gleak.run_trial: seed", 0, MAX_SEED)  # as a suite's seeds: [0, 2**63)
    spec = _with_protocol({"case": case, "attack": [_table(attack, "attack")], "defense": [_table(defense, "defense")]},
                          protocol)  # fmt: skip
    trials = _suite.expand_grid(spec, _suite.Where(Path("gleak.run_trial")), "suite", API_SUITE, [seed])
    if len(trials) != 1:
        raise InputError(f"gleak.run_trial: these arguments expand to {len(trials)} trials (a list value is a grid); "
                         "run a grid with gleak.run and a suite file")  # fmt: skip
    return trials[0]


def case_data(split: str = "train", **case: Any) -> Any:
    """The case's data set as a trial loads it (`split`: "train", where victims come from for an untrained model, or
    "test"): an ImageDataset with `.x` in [0, 1], `.y`, `.mean`, `.std` and `.model_input(idx, dtype)`, the
    normalised tensor a model takes. `case`: the [case] keys, validated as in a suite (gleak.run_trial)."""
    from gleak.orchestration.trial import load_case_data

    if split not in ("train", "test"):
        raise InputError(f"gleak.case_data: split must be 'train' or 'test', got {split!r}")
    return load_case_data(trial_config("closed-form", seed=0, **case), split)


def case_model(seed: int = 0, **case: Any) -> Any:
    """The model a trial of this case with `seed` attacks (a torch module): untrained, the very weights that trial
    starts from; `model_state = "trained"` or `"file:PATH"`, that model. Train it your way and save its
    `state_dict()` to attack your own checkpoint (`model_state = "file:PATH"`, docs/models.md)."""
    from gleak.mechanics.pretrain import build_model
    from gleak.orchestration.trial import DTYPES, load_case_data

    cfg = trial_config("closed-form", seed=seed, **case)  # the attack is not part of the model: any one validates
    model, _ = build_model(cfg.case, load_case_data(cfg), cfg.seed, DTYPES[cfg.case.dtype])
    return model


def run_trial(
    config: TrialConfig | None = None,
    *,
    attack: Any = None,
    defense: Any = "none",
    protocol: Any = None,
    seed: int = 0,
    threads: int | None = 1,
    lpips_weights: str | None = None,
    check: bool = True,
    device: str = "cpu",
    **case: Any,
) -> TrialResult:
    """Run one trial in this process and return its TrialResult.

    Either a TrialConfig, or attack / defense (a registered name, or a dict {"name": ..., parameter: value}),
    protocol (None: the default FedSGD round), seed and the [case] keys (dataset, model, batch_size, ...).
    threads: torch threads during the trial (1, the default of `gleak run`, gives the suite's bit-identical
    numbers; None leaves torch's setting). device: auto, cpu, cuda or cuda:N (gleak.mechanics.device; not part of the trial
    id, recorded in result.extra["device"]). check: raise TrialFailed when the trial fails (UnsupportedCase when it is
    not applicable: status "not-applicable"), else return the result with its row.

    Raises, before anything runs: gleak.InputError (one line naming the argument) for a bad argument (config not a
    TrialConfig, a seed outside [0, 2**63), threads not a whole number >= 1, an lpips_weights file that is missing
    or not a weights file, an unknown device or case key), gleak.UnknownPluginError (an InputError) for a name that
    is not registered. After the trial: TrialFailed or UnsupportedCase (with check=True)."""
    import torch

    from gleak.mechanics.device import resolve
    from gleak.orchestration.trial import run_trial as _run_trial

    if config is not None and not isinstance(config, TrialConfig):
        hint = f" (to run the attack {config!r}: run_trial(attack={config!r}))" if isinstance(config, str) else ""
        raise InputError(f"gleak.run_trial: config must be a gleak.contracts.config.TrialConfig, got {type(config).__name__} "
                         f"{str(config)[:40]!r}{hint}")  # fmt: skip
    if threads is not None:
        _whole(threads, "gleak.run_trial: threads", 1)
    _flag(check, "gleak.run_trial: check")
    if not isinstance(device, str):
        raise InputError(f"gleak.run_trial: device must be auto, cpu, cuda or cuda:N, got {device!r}")
    lpips_weights = _lpips_arg(lpips_weights, "gleak.run_trial: lpips_weights")
    device = resolve(device, "gleak.run_trial: device")
    if config is None:
        if attack is None:
            raise InputError("gleak.run_trial: give a TrialConfig or attack=NAME")
        config = trial_config(attack, defense, protocol, seed, **case)
    elif attack is not None or case or protocol is not None:
        raise InputError("gleak.run_trial: give either a TrialConfig or attack/defense/case keys, not both")
    images: dict[str, Any] = {}

    def keep(truth: Tensor, rec: Tensor | None) -> None:
        images.update(truth=truth, reconstruction=rec)

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        row = _run_trial(config, lpips_weights, None, on_images=keep, device=device)
    finally:
        torch.set_num_threads(previous)
    if check and row["status"] == NOT_APPLICABLE:
        raise UnsupportedCase(f"trial {config.trial_id} ({config.attack} vs {config.defense}) is not applicable: {row['error']}")
    if check and row["status"] != "ok":
        raise TrialFailed(f"trial {config.trial_id} ({config.attack} vs {config.defense}) failed: {row['error']}\n"
                          f"{row.get('traceback', '')}", row)  # fmt: skip
    return TrialResult(config, row, images.get("truth"), images.get("reconstruction"))


@dataclass
class RunResult:
    """What `run` did: counts, the output folder, and its trials as a DataFrame (`gleak.results(out)`)."""

    out: Path
    total: int
    skipped: int
    ran: int
    failed: int
    rows: pd.DataFrame = field(repr=False)

    @property
    def exit_code(self) -> int:
        """The command line's exit status for this run: 0 all trials ran, 1 some failed."""
        return 1 if self.failed else 0

    @property
    def leaderboard(self) -> Path:
        return self.out / "leaderboard.md"

    @property
    def utility(self) -> pd.DataFrame | None:
        """utility.csv as a DataFrame, where the suite has a [utility] table."""
        from gleak.reporting.documents.tables import unquoted

        path = self.out / "utility.csv"
        return unquoted(pd.read_csv(path)) if path.is_file() else None

    @property
    def figures(self) -> list[Path]:
        return sorted((self.out / "figures").glob("*.png"))


def run(
    suite: Any = None,
    out: str | Path | None = None,
    workers: int | str = 1,
    *,
    threads: int = 1,
    executor: str = "local",
    progress: bool = True,
    plugins: tuple[str, ...] | list[str] = (),
    lpips_weights: str | None = None,
    device: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
) -> RunResult:
    """Run a suite as `gleak run` does (validated first, stored trials skipped, reports written) and return a
    RunResult. suite: a path, a shipped suite's name (default quick) or a gleak.orchestration.suite.Suite; out: the output folder
    (default results/<suite name>/, as on the command line); workers: local processes, or 'auto'; device: as
    `gleak run --device` (None: the suite's [suite] device, else cpu); overrides: "KEY=VALUE" settings changed from
    the suite file, as `gleak run --set` (a changed suite needs its own `out`).

    Raises, before the folder is touched: gleak.InputError (one line naming the argument or the file) for a bad
    argument (threads or workers not a whole number >= 1, an unknown executor, an lpips_weights file that is missing
    or not a weights file, an out that is not a path, plugins not a list of files) and for a bad suite, plugin or
    output folder, as `gleak run` exits 2 for them."""
    from gleak.contracts.registry import load_plugin_file
    from gleak.orchestration.runner import EXECUTORS, run_suite
    from gleak.orchestration.suite import Suite, find_suite, load_suite
    from gleak.orchestration.workers import usable_cores

    _whole(threads, "gleak.run: threads", 1)
    if executor not in EXECUTORS:
        raise InputError(f"gleak.run: executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    _flag(progress, "gleak.run: progress")
    if isinstance(plugins, (str, Path)) or not all(isinstance(f, (str, Path)) for f in plugins):
        raise InputError(f"gleak.run: plugins must be a list of plugin files, got {plugins!r}")
    if out is not None:
        out = _folder_arg(out, "gleak.run: out")
    if not (suite is None or isinstance(suite, (str, Path, Suite))):
        raise InputError(f"gleak.run: suite must be a suite file, a shipped suite's name or a gleak.orchestration.suite.Suite, got {suite!r}")
    lpips_weights = _lpips_arg(lpips_weights, "gleak.run: lpips_weights")
    if device is not None:  # named as the Python argument, not as the command line's --device
        from gleak.mechanics.device import resolve

        device = resolve(device, "gleak.run: device")
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise InputError(f"gleak.run: overrides must be a list of 'KEY=VALUE' strings, got {overrides!r}")
    if overrides and (out is None or isinstance(suite, Suite)):
        raise InputError("gleak.run: overrides change a suite file: name the folder for its results with out "
                         "(and pass the suite as a file or a shipped suite's name)")  # fmt: skip
    for f in plugins:
        load_plugin_file(f)
    s = suite if isinstance(suite, Suite) else load_suite(find_suite(None if suite is None else str(suite)),
                                                          overrides=list(overrides))  # fmt: skip
    out = Path(out) if out is not None else Path("results") / s.name
    if workers == "auto":
        workers = max(1, usable_cores() // threads)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"gleak.run: workers must be a number >= 1 or 'auto', got {workers!r}")
    from gleak.reporting.report import write_folder_reports as write_reports

    # The reports as `gleak run` writes them: once the run has stored everything, before it releases the folder.
    summary = run_suite(s, out, workers=workers, progress=progress, lpips_weights=lpips_weights, threads=threads,
                        executor=executor, plugin_files=tuple(str(Path(f).resolve()) for f in plugins), device=device,
                        reports=lambda o: write_reports(o, s.name, s.description, locked=True))  # fmt: skip
    return RunResult(summary.out, summary.total, summary.skipped, summary.ran, summary.failed, results(summary.out))


# -- reading results ----------------------------------------------------------------------------------------------
_TEXT_COLUMNS = ("suite", "trial_id", "attack", "attack_params", "defense", "defense_params", "model", "dataset",
                 "status", "verdict", "error", "image", "extra", "case")  # fmt: skip


def _flat(d: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(d, dict):
        for k, v in d.items():
            _flat(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = d


def flatten_params(df: pd.DataFrame) -> pd.DataFrame:
    """Each JSON column (attack_params, defense_params, any other *_params, case, extra) spread into one column per
    key, named KIND.KEY (attack.iterations, defense.ratio, case.model_params.hidden, extra.share_psnr40); nested
    tables joined with dots. The JSON columns stay."""
    sources = [c for c in df.columns if c.endswith("_params")] + [c for c in ("case", "extra") if c in df.columns]
    new: dict[str, list[Any]] = {}
    for col in sources:
        prefix = col[: -len("_params")] if col.endswith("_params") else col
        flat_rows = []
        for v in df[col]:
            d: dict[str, Any] = {}
            if isinstance(v, str) and v:
                _flat(json.loads(v), prefix, d)
            flat_rows.append(d)
        keys = list(dict.fromkeys(k for d in flat_rows for k in d))
        for k in keys:
            if k in df.columns or k in new:
                continue
            new[k] = [d.get(k) for d in flat_rows]
    return pd.concat([df.reset_index(drop=True), pd.DataFrame(new, index=range(len(df)))], axis=1)


def results(folder: str | Path, *, flatten: bool = True) -> pd.DataFrame:
    """The trials of an output folder as a DataFrame: results.csv's columns (DESIGN.md), then with flatten one
    column per plugin parameter and case key (see flatten_params). Reads the store (results.sqlite) where there is
    one, so that it is current during a run; else results.csv (the published folders of a fresh clone).

    Raises gleak.InputError (one line naming the folder or the file) when `folder` is not a path, holds no results,
    or its store or results.csv is damaged or not gleak's (nothing in the folder is changed)."""
    from gleak.orchestration.store import CSV_COLUMNS, Store
    from gleak.orchestration.stored_values import check_committed
    from gleak.reporting.report import results_frame

    folder = _folder_arg(folder, "gleak.results: folder")
    _flag(flatten, "gleak.results: flatten")
    if Store.exists(folder):
        store = Store.open_existing(folder)
        try:
            df = results_frame(store)[CSV_COLUMNS]
        finally:
            store.close()
    elif (folder / "results.csv").is_file():
        check_committed(folder)  # a binary or edited results.csv: one line, not a decoder's traceback
        df = pd.read_csv(folder / "results.csv", dtype={c: str for c in _TEXT_COLUMNS})  # ids stay text
        for c in _TEXT_COLUMNS:  # empty text cells as None, as the store gives them
            if c in df.columns:
                df[c] = df[c].astype(object).where(df[c].notna(), None)
        from gleak.reporting.documents.tables import unquoted

        df = unquoted(df)  # a text cell that was quoted for spreadsheets (=, +, -, @ first) as it was stored
    else:
        raise InputError(f"{folder}: no results here (neither results.sqlite nor results.csv)")
    return flatten_params(df) if flatten else df


# -- comparing two output folders ---------------------------------------------------------------------------------
def _labels(df: pd.DataFrame, kind: str) -> list[str]:
    """'name' or 'name (k=v, ...)' with the parameters that differ between the configurations of that name."""
    from gleak.reporting.aggregate import varying_keys

    vary = varying_keys(df, kind)
    out = []
    for name, js in zip(df[kind], df[f"{kind}_params"]):
        d = json.loads(js) if isinstance(js, str) and js else {}
        shown = ", ".join(f"{k}={d[k]}" for k in sorted(vary.get(name, ())) if k in d)
        out.append(f"{name} ({shown})" if shown else name)
    return out


def compare(a: str | Path, b: str | Path) -> pd.DataFrame:
    """The leaderboard cells (case, defense config, attack config; aggregated over seeds as the leaderboard does) of
    two output folders side by side: trials, mean PSNR and label accuracy in each, their differences (B - A), the
    spread (the larger standard deviation of PSNR over seeds of the two) and whether the PSNR moved beyond it.
    Column `in`: 'both', 'A' or 'B' (a cell only one folder has)."""
    import math

    import numpy as np

    from gleak.reporting.aggregate import CASE_KEYS, aggregate

    frames = {"a": results(a, flatten=False), "b": results(b, flatten=False)}
    keys = CASE_KEYS + ["variant", "defense", "defense_params", "attack", "attack_params"]
    both = pd.concat([frames["a"], frames["b"]], ignore_index=True)
    label = dict(zip(zip(both["defense"], both["defense_params"]), _labels(both, "defense")))
    label.update(dict(zip(zip(both["attack"], both["attack_params"]), _labels(both, "attack"))))
    aggs = {}
    for side, df in frames.items():
        g = aggregate(df) if len(df) else pd.DataFrame(columns=keys + ["trials", "psnr", "psnr_std", "label_acc"])
        aggs[side] = g[keys + ["trials", "psnr", "psnr_std", "label_acc"]].astype({k: str for k in keys})
    m = aggs["a"].merge(aggs["b"], on=keys, how="outer", suffixes=("_a", "_b"), indicator=True, sort=False)

    def num(v: Any) -> float:
        return float("nan") if v is None else float(v)

    def diff(x: Any, y: Any) -> float:
        x, y = num(x), num(y)
        if math.isinf(x) and math.isinf(y) and (x > 0) == (y > 0):
            return 0.0  # both exact: no change (inf - inf is not one)
        return y - x

    rows = []
    for _, r in m.iterrows():
        d_psnr = diff(r["psnr_a"], r["psnr_b"])
        spread = float(np.nanmax([num(r["psnr_std_a"]), num(r["psnr_std_b"]), 0.0]))
        d_lab = diff(r["label_acc_a"], r["label_acc_b"])
        changed = any(not math.isnan(v) and v != 0 for v in (d_psnr, d_lab))
        variant = f" ({r['variant']})" if r["variant"] not in ("", "nan") else ""
        rows.append({
            "case": f"{r['dataset']}/{r['model']}/B={r['batch_size']}{variant}",
            "defense": label.get((r["defense"], r["defense_params"]), r["defense"]),
            "attack": label.get((r["attack"], r["attack_params"]), r["attack"]),
            "in": {"both": "both", "left_only": "A", "right_only": "B"}[r["_merge"]],
            "trials_a": r["trials_a"], "trials_b": r["trials_b"],
            "psnr_a": num(r["psnr_a"]), "psnr_b": num(r["psnr_b"]), "d_psnr": d_psnr, "spread": spread,
            "label_acc_a": num(r["label_acc_a"]), "label_acc_b": num(r["label_acc_b"]), "d_label_acc": d_lab,
            "changed": changed, "beyond_spread": bool(not math.isnan(d_psnr) and abs(d_psnr) > spread),
            **{k: r[k] for k in ("defense_params", "attack_params")},
        })  # fmt: skip
    return pd.DataFrame(rows)
