"""Suites: TOML files that describe a grid of trials. Parsed, validated completely, then expanded.

    [suite]                      name, seeds (a list, or N for 0..N-1), description, save_images,
                                 verdict ("margin", default, or "seed002": see gleak.mechanics.metrics), device (auto, cpu,
                                 cuda or cuda:N; `gleak run --device` overrides it; see gleak.mechanics.device)
    [case]                       keys of gleak.contracts.config.CaseConfig; a list value expands the grid; `protocol` names
                                 the round protocol (fedsgd by default) and `protocol_params` its parameters
    [[attack]] / [[defense]]     name plus parameters; a list value expands the grid
    [[grid]]                     optional sub-grids: each may override seeds, case, attack and defense
    [utility]                    optional: keys of gleak.contracts.config.UtilityConfig (accuracy under each defense)
    [[claim]]                    optional: a published claim the leaderboard checks (gleak.reporting.claims): source, claim,
                                 defense, defense_params (a partial match), attacks, case (model, batch_size,
                                 dataset: a partial match), expect ("defended" or "leaks")

Every error is one line that names the file, the table and the key.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gleak.contracts import registry
from gleak.contracts.config import (
    CASE_FIELDS,
    CASE_RENAMED,
    UTILITY_FIELDS,
    UTILITY_RENAMED,
    CaseConfig,
    TrialConfig,
    UtilityConfig,
    current_names,
    utility_lr_names,
)  # fmt: skip
from gleak.contracts.config_checks import check_case_values, check_utility_values
from gleak.contracts.errors import InputError, UnknownPluginError, Where
from gleak.contracts.errors import did_you_mean as _close
from gleak.mechanics.modality import modality_of
from gleak.orchestration.suite_claims import parse_claims

SUITE_KEYS = {"name", "seeds", "description", "save_images", "verdict", "device", "threat_model"}
TOP_TABLES = {"suite", "case", "attack", "defense", "grid", "utility", "claim"}
GRID_KEYS = {"name", "seeds", "case", "attack", "defense"}
MAX_SEED = 2**63
MAX_SEED_COUNT = 100_000
MAX_NAME_BYTES = 100  # a suite's name is the default output folder's name: room left for the file system's 255
# The most trials one suite may expand to, counted before expanding (count_trials): at 10^5 a suite already takes
# tens of seconds to load and plan, and 10^6 took 500 s and a gigabyte before the first trial.
MAX_TRIALS = 100_000
MAX_MODEL_SIZE = 65_536  # every integer of model_params (widths, depths): 1 .. this


def check_suite_name(name: Any) -> str | None:
    """The problem with `name` as a suite name (it names the default output folder results/NAME), or None: a single
    safe path component, not '.' or '..', no separator, control character or NUL, not hidden, not too long."""
    if not isinstance(name, str) or not name:
        return f"must be a non-empty string, got {name!r}"
    if name in (".", "..") or name.startswith("."):
        return f"must not start with '.' (it names the output folder results/NAME), got {name!r}"
    if any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return f"must be a single folder name: no '/', '\\', NUL or control characters, got {name!r}"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"must be at most {MAX_NAME_BYTES} bytes long (it names the output folder), got {len(name.encode('utf-8', 'surrogatepass'))}"
    return None


@dataclass
class Suite:
    name: str
    path: Path
    trials: list[TrialConfig]
    description: str = ""
    save_images: bool = True
    extra_tables: dict[str, Any] = field(default_factory=dict)
    utility: UtilityConfig | None = None  # the [utility] table, validated
    verdict: str = "margin"  # the verdict rule of its leaderboard (gleak.mechanics.verdicts.VERDICT_RULES)
    claims: list[dict[str, Any]] = field(default_factory=list)  # the [[claim]] tables, validated (gleak.reporting.claims)
    device: str | None = None  # [suite] device, as written (gleak.mechanics.device: resolved when the suite runs)
    # kind -> plugin name -> the parameters the file sets for it: the reports show them with their values even where
    # a value is the default (a stored configuration has every default filled in, so only the file says what was set)
    set_params: dict[str, dict[str, list[str]]] = field(default_factory=dict)


_Where = Where  # the name this module's validators use


def find_suite(name_or_path: str | None) -> Path:
    """A suite file: a path, or the name of a shipped suite (suites/NAME.toml). None means the default, quick."""
    if name_or_path is None:
        name_or_path = "quick"
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise InputError(f"{p}: suite file not found")
        return p
    local = Path("suites") / f"{name_or_path}.toml"
    if local.is_file():
        return local
    shipped = resources.files("gleak.suites") / f"{name_or_path}.toml"
    if shipped.is_file():
        return Path(str(shipped))
    names = sorted(f.name[:-5] for f in resources.files("gleak.suites").iterdir() if f.name.endswith(".toml"))
    raise InputError(f"no suite named {name_or_path!r}{_close(name_or_path, names)} (shipped: {', '.join(names)})")


def _is_list_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_is_list_type(a) for a in typing.get_args(tp))
    return tp in (list, tuple) or origin in (list, tuple)


def _expands(v: Any, annotation: Any) -> bool:
    """Whether a parameter's value is a list of grid points (not one value of a list-typed parameter)."""
    return isinstance(v, list) and (not _is_list_type(annotation) or bool(v and all(isinstance(e, list) for e in v)))


def count_trials(spec: dict[str, Any], seeds: list[int]) -> int:
    """How many trials a grid (`spec`: its case, attack and defense tables) expands to for `seeds`, counted from
    its list lengths without building anything: a grid past MAX_TRIALS is refused before it takes minutes and
    gigabytes to expand. Malformed tables count as one point (their own checks then say what is wrong)."""
    case = spec.get("case")
    n = _points(case, typing.get_type_hints(CaseConfig)) if isinstance(case, dict) else 1
    for kind in ("attack", "defense"):
        entries = spec.get(kind)
        entries = [entries] if isinstance(entries, dict) else entries if isinstance(entries, list) else []
        n *= max(1, sum(_plugin_points(kind, e) for e in entries))
    return n * max(1, len(seeds))


def _points(params: dict[str, Any], annotations: dict[str, Any]) -> int:
    return math.prod(len(v) for k, v in params.items() if _expands(v, annotations.get(k, Any)))


def _plugin_points(kind: str, entry: Any) -> int:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return 1
    try:
        info = registry.plugin_info(kind, registry.resolve_name(kind, entry["name"]))
    except InputError:
        return 1
    params = {k: v for k, v in entry.items() if k != "name"}
    return _points(params, {p.name: p.annotation for p in info.params.values()})


# The most pixel values one trial's round may hold in its images: batch_size x clients x channels x resolution^2
# (channels 3 where the case does not set them). 2**25 values are 256 MiB at float64 per copy of the round's
# images, and a trial holds several copies (the clients' batches, the reconstruction, the blind guess, the scoring),
# so a trial within it stays under a few GiB; 1024 x 1024 at batch 64 (201 million values) is over it, 1024 x 1024
# at batch 8 or 256 x 256 at batch 64 is within. Checked before any data is built.
MAX_ROUND_VALUES = 2**25


def _check_memory(cases: list[CaseConfig], where: "_Where", table: str) -> None:
    """One line, before any data set is loaded, for a case whose round would hold more than MAX_ROUND_VALUES."""
    for c in cases:
        if c.resolution is None:  # the data set's own size: known only once it is read
            continue
        channels = c.channels or 3
        values = c.batch_size * c.clients * channels * c.resolution**2
        if values > MAX_ROUND_VALUES:
            raise where.error(table, "resolution", f"resolution {c.resolution} x {c.resolution} x {channels} channels at "
                              f"batch_size {c.batch_size} x {c.clients} clients is {values:,} pixel values per round, "
                              f"more than the {MAX_ROUND_VALUES:,} (256 MiB at float64) a trial may hold; lower the "
                              "resolution or the batch size")  # fmt: skip


def _check_count(n: int, where: "_Where", table: str) -> None:
    if n > MAX_TRIALS:
        raise where.error(table, None, f"the suite expands to {n:,} trials, more than the {MAX_TRIALS:,} one suite may "
                          "hold; split it into several suites (or fewer grid values)")  # fmt: skip


def _axes(params: dict[str, Any], annotations: dict[str, Any]) -> list[dict[str, Any]]:
    """Expand list values into a grid. A list is one value when the parameter itself is a list (then a list of
    lists expands)."""
    keys, choices = [], []
    for k, v in params.items():
        if _expands(v, annotations.get(k, Any)):
            if not v:
                raise ValueError(f"{k}: an empty list expands to no trials")
            keys.append(k)
            choices.append(v)
    if not keys:
        return [dict(params)]
    out = []
    for combo in itertools.product(*choices):
        d = dict(params)
        d.update(zip(keys, combo))
        out.append(d)
    return out


def _seeds(value: Any, where: _Where, table: str) -> list[int]:
    if isinstance(value, bool):
        raise where.error(table, "seeds", "must be a list of integers or a count")
    if isinstance(value, int):
        if value < 1:
            raise where.error(table, "seeds", f"a count must be >= 1, got {value}")
        if value > MAX_SEED_COUNT:
            raise where.error(table, "seeds", f"a count must be <= {MAX_SEED_COUNT}, got {value}")
        return list(range(value))
    if isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        if len(set(value)) != len(value):
            raise where.error(table, "seeds", "has duplicates")
        bad = [s for s in value if not 0 <= s < MAX_SEED]
        if bad:  # a trial's seed is stored as SQLite's 64-bit INTEGER and derives torch seeds
            raise where.error(table, "seeds", f"each seed must be in [0, 2**63), got {bad[0]}")
        return list(value)
    raise where.error(table, "seeds", f"must be a non-empty list of integers or a count, got {value!r}")


def _plugins(kind: str, entries: Any, where: _Where, table: str,
             validated: dict[tuple[str, str, str], dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
    """Validate [[attack]] / [[defense]] entries; return (name, full params) for each grid point. `validated`: the
    points a suite has validated already, (kind, name, params) -> full params: grids sharing the file's tables
    build each plugin configuration once, not once per grid."""
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or not entries:
        raise where.error(table, None, f"needs at least one [[{kind}]] table with a 'name'")
    out = []
    for i, entry in enumerate(entries, 1):
        t = f"{kind} #{i}" if table == kind else f"{table}.{kind} #{i}"
        if not isinstance(entry, dict):
            raise where.error(t, None, f"must be a table, got {entry!r}")
        if "name" not in entry:
            raise where.error(t, "name", "missing")
        name = entry["name"]
        if not isinstance(name, str):
            raise where.error(t, "name", f"must be a string, got {name!r}")
        params = {k: v for k, v in entry.items() if k != "name"}
        try:
            name = registry.resolve_name(kind, name)  # a renamed plugin's old name: the new one (same trial ids)
            info = registry.plugin_info(kind, name)
        except UnknownPluginError as exc:
            raise where.error(t, "name", str(exc)) from None
        annotations = {p.name: p.annotation for p in info.params.values()}
        try:
            grid = _axes(params, annotations)
        except ValueError as exc:
            raise where.error(t, str(exc).split(":")[0], str(exc).split(": ", 1)[1]) from None
        for point in grid:
            key = (kind, name, json.dumps(point, sort_keys=True, default=repr))
            if key not in validated:
                try:
                    validated[key] = registry.check_params(kind, name, point)
                    _create_in_time(kind, name, point)  # the plugin's own value checks
                except registry.ParamError as exc:
                    validated.pop(key, None)
                    raise where.error(t, exc.key, str(exc)) from None
                except InputError as exc:
                    validated.pop(key, None)
                    raise where.error(t, None, str(exc)) from None
            out.append((name, dict(validated[key])))
    return out


def _create_in_time(kind: str, name: str, params: dict[str, Any]) -> Any:
    """registry.create within the construction time limit (gleak.contracts.plugin_guards.init_timeout, 60 s unless
    $GLEAK_PLUGIN_INIT_TIMEOUT says otherwise): a plugin whose __init__ hangs is one line naming it."""
    from gleak.contracts.plugin_guards import INIT_TIMEOUT_ENV, ConstructionTimeout, construction_timeout, init_timeout

    seconds = init_timeout()
    try:
        with construction_timeout(seconds):
            return registry.create(kind, name, **params)
    except ConstructionTimeout:
        raise InputError(f"{kind} {name!r}: __init__ did not return within {seconds:g} s (a plugin's construction "
                         f"must be quick; ${INIT_TIMEOUT_ENV} sets the limit)") from None


def _current(raw: dict[str, Any], renamed: dict[str, str], where: _Where, table: str) -> dict[str, Any]:
    """A table's keys in their current names (a renamed key's old spelling is accepted; both at once is an error)."""
    try:
        return current_names(raw, renamed)
    except KeyError as exc:
        raise where.error(table, exc.args[0], exc.args[1]) from None


def _cases(raw: Any, where: _Where, table: str) -> list[CaseConfig]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise where.error(table, None, "must be a table")
    raw = _current(raw, CASE_RENAMED, where, table)
    for k in raw:
        if k not in CASE_FIELDS:
            raise where.error(table, k, f"unknown key{_close(k, [*CASE_FIELDS, *CASE_RENAMED])} (keys: {', '.join(CASE_FIELDS)})")
    hints = typing.get_type_hints(CaseConfig)
    try:
        points = _axes(raw, hints)
    except ValueError as exc:
        raise where.error(table, str(exc).split(":")[0], str(exc).split(": ", 1)[1]) from None
    cases = []
    for point in points:
        for k, v in point.items():
            if not registry.check_value(hints[k], v):
                raise where.error(table, k, f"must be {registry.expected(hints[k], v)}")
        case = CaseConfig(**point)
        for k, problem in check_case_values(case) + modality_of(case).case_problems(case):
            raise where.error(table, k, problem)
        case = dataclasses.replace(case, model_params=_model_params(case.model, case.model_params, where, table))
        cases.append(dataclasses.replace(case, **_protocol(case, where, table)))
    return cases


def _protocol(case: CaseConfig, where: _Where, table: str) -> dict[str, Any]:
    """The case's protocol (current name) and its full parameters, or an error naming the key. The default
    (fedsgd without parameters) stays as it is, outside the trial's identity."""
    if case.protocol == "fedsgd" and not case.protocol_params:
        return {}
    try:
        name = registry.resolve_name("protocol", case.protocol)
        registry.plugin_info("protocol", name)
    except UnknownPluginError as exc:
        raise where.error(table, "protocol", str(exc)) from None
    try:
        full = registry.check_params("protocol", name, case.protocol_params)
        _create_in_time("protocol", name, case.protocol_params)  # the plugin's own value checks
    except registry.ParamError as exc:
        raise where.error(table, f"protocol_params.{exc.key}" if exc.key else "protocol_params", str(exc)) from None
    if case.update == "fedavg":
        raise where.error(table, "update", f"'fedavg' is a protocol: with protocol = {name!r}, set its parameters in "
                          "protocol_params (or protocol = 'fedavg')")  # fmt: skip
    return {"protocol": name, "protocol_params": full}


def _model_params(model: str, params: dict[str, Any], where: _Where, table: str) -> dict[str, Any]:
    """The model's full parameters (defaults filled in), or an error naming the model or the parameter."""
    try:
        registry.plugin_info("model", model)
    except UnknownPluginError as exc:
        raise where.error(table, "model", str(exc)) from None
    try:
        full = registry.check_params("model", model, params)
    except registry.ParamError as exc:
        raise where.error(table, f"model_params.{exc.key}" if exc.key else "model_params", str(exc)) from None
    for k, v in full.items():  # widths and depths: a negative or astronomical one is refused, not built
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and not isinstance(x, bool) and not 1 <= x <= MAX_MODEL_SIZE:
                raise where.error(table, f"model_params.{k}", f"model {model!r}: each integer must be in [1, {MAX_MODEL_SIZE}], got {x}")
    return full


def _utility(raw: Any, where: _Where) -> UtilityConfig:
    """The [utility] table: one training configuration (lists are values, not grids), its data set loaded once."""
    table = "utility"
    if not isinstance(raw, dict):
        raise where.error(table, None, "must be a table")
    hints = typing.get_type_hints(UtilityConfig)
    raw = _current(raw, UTILITY_RENAMED, where, table)
    try:
        raw = utility_lr_names(raw)
    except KeyError as exc:
        raise where.error(table, exc.args[0], exc.args[1]) from None
    for k, v in raw.items():
        if k not in UTILITY_FIELDS:
            raise where.error(table, k, f"unknown key{_close(k, [*UTILITY_FIELDS, *UTILITY_RENAMED, 'lr'])} (keys: {', '.join(UTILITY_FIELDS)})")
        if not registry.check_value(hints[k], v):
            raise where.error(table, k, f"must be {registry.expected(hints[k], v)}")
    u = UtilityConfig(**raw)
    for k, problem in check_utility_values(u) + modality_of(u).case_problems(u):
        raise where.error(table, k, problem)
    u = dataclasses.replace(u, model_params=_model_params(u.model, u.model_params, where, table))
    try:
        shard = len(modality_of(u).load(u, "train")) // u.clients
        modality_of(u).load(u, "test")
    except InputError as exc:
        raise where.error(table, "dataset", str(exc)) from None
    need = u.batch_size * u.local_steps
    if need > shard:
        raise where.error(table, "batch_size", f"batch_size x local_steps = {need} exceeds a client's shard of {shard} samples")
    return u


def _check_data(cases: list[CaseConfig], where: _Where, table: str) -> None:
    """Load each distinct data set once so that a missing one stops the suite before anything runs."""
    seen = set()
    for c in cases:
        key = (c.dataset, c.data_root, c.resolution, c.channels, c.download, c.seq_len, c.vocab_size, c.model)
        if c.model_state.startswith("file:"):  # each checkpoint is checked against each model it is loaded into
            key += (c.model_state, c.model, repr(sorted(c.model_params.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            ds = modality_of(c).load(c, "train")
        except InputError as exc:
            raise where.error(table, "dataset", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a corrupt image in a folder: dataset, an unreadable file: bad input
            raise where.error(table, "dataset", f"{c.dataset!r} could not be loaded: {type(exc).__name__}: {exc}") from None
        if c.model_state.startswith("file:"):  # the checkpoint against the architecture: one line before anything runs
            from gleak.mechanics.models import create_model
            from gleak.mechanics.pretrain import checkpoint_state

            try:
                checkpoint_state(c.model_state[len("file:"):], create_model(c.model, ds.input_shape, ds.num_classes, seed=0,
                                                                            **c.model_params))  # fmt: skip
            except InputError as exc:
                raise where.error(table, "model_state", str(exc)) from None
        need = c.batch_size * c.clients
        if need > len(ds):
            raise where.error(table, "batch_size", f"batch_size x clients = {need} exceeds the {len(ds)} samples of {c.dataset!r}")


def expand_grid(spec: dict[str, Any], where: Where, table: str, suite_name: str, seeds: list[int],
                validated: dict[tuple[str, str, str], dict[str, Any]] | None = None) -> list[TrialConfig]:  # fmt: skip
    """The trials of one grid (`spec`: its case, attack and defense tables) for `seeds`, validated, defaults filled:
    what a suite's top level or one [[grid]] expands to (gleak.api.run_trial expands its arguments with it too).
    validated: the plugin configurations the suite's other grids validated (`_plugins`), shared between them."""
    validated = {} if validated is None else validated
    _check_count(count_trials(spec, seeds), where, table)
    cases = _cases(spec.get("case"), where, f"{table}.case" if table != "suite" else "case")
    _check_memory(cases, where, f"{table}.case" if table != "suite" else "case")  # before any data is built
    _check_data(cases, where, f"{table}.case" if table != "suite" else "case")
    attacks = _plugins("attack", spec.get("attack"), where, "attack" if table == "suite" else table, validated)
    defenses = _plugins("defense", spec.get("defense"), where, "defense" if table == "suite" else table, validated)
    trials = []
    where_d = "defense" if table == "suite" else table
    protocol_of = {d: registry.plugin_info("defense", d).protocol for d, _ in defenses}  # a defense that is a protocol
    for case, (a, ap), (d, dp), seed in itertools.product(cases, attacks, defenses, seeds):
        named = protocol_of[d]
        if named and (case.protocol != "fedsgd" or case.protocol_params):
            raise where.error(where_d, "name", f"defense {d!r} is the protocol {named!r}; the case also names protocol "
                              f"{case.protocol!r}: name the protocol once")  # fmt: skip
        trials.append(TrialConfig(suite_name, a, ap, *one_spelling(d, dp, case), seed))
    return trials


def one_spelling(defense: str, defense_params: dict[str, Any], case: CaseConfig) -> tuple[str, dict[str, Any], CaseConfig]:
    """The one spelling of a trial's protocol, before its id is computed: a protocol named in the case
    (`[case] protocol = "cgd"`) with no client defense is the same computation as that protocol's defense spelling
    (`[[defense]] name = "cgd"`, gleak.contracts.registry.register_protocol(as_defense=True)), so it is written that way: one
    computation, one trial id, and that id is the one the published trials of that spelling have. A protocol with a
    client defense beside it, or with a parameter that spelling does not take set off its default, has no other
    spelling and stays as it is."""
    if defense != "none" or defense_params or case.protocol == "fedsgd" or case.update != "fedsgd":
        return defense, defense_params, case
    try:
        info = registry.plugin_info("defense", case.protocol)
    except UnknownPluginError:
        return defense, defense_params, case
    if info.protocol != case.protocol:
        return defense, defense_params, case
    params = dict(case.protocol_params)
    defaults = registry.plugin_info("protocol", case.protocol).defaults()
    if any(k not in info.params and v != defaults.get(k, object()) for k, v in params.items()):
        return defense, defense_params, case
    spelled = registry.check_params("defense", case.protocol, {k: v for k, v in params.items() if k in info.params})
    return case.protocol, spelled, dataclasses.replace(case, protocol="fedsgd", protocol_params={})




def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: suite file not found") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the suite file: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML: {exc}") from None


def _grid_tables(doc: dict[str, Any], grids: Any, where: _Where, name: str, seeds: list[int]) -> list[TrialConfig]:
    """The trials of the [[grid]] tables, in order: each grid's [case] over the file's, its own attacks, defenses
    and seeds where it names them."""
    if not isinstance(grids, list):
        raise where.error("grid", None, "must be an array of tables ([[grid]])")
    trials: list[TrialConfig] = []
    counted = 0
    validated: dict[tuple[str, str, str], dict[str, Any]] = {}  # each plugin configuration built once per suite
    for i, g in enumerate(grids, 1):
        table = f"grid #{i}" + (f" ({g.get('name')})" if isinstance(g, dict) and g.get("name") else "")
        if not isinstance(g, dict):
            raise where.error(table, None, "must be a table")
        for k in g:
            if k not in GRID_KEYS:
                raise where.error(table, k, f"unknown key{_close(k, GRID_KEYS)} (keys: {', '.join(sorted(GRID_KEYS))})")
        for key, t in (("case", g), ("case", doc)):
            if not isinstance(t.get(key, {}), dict):
                raise where.error(table if t is g else "case", key if t is g else None, "must be a table")
        merged = {
            "case": {**_current(doc.get("case", {}), CASE_RENAMED, where, "case"),
                     **_current(g.get("case", {}), CASE_RENAMED, where, table)},
            "attack": g.get("attack", doc.get("attack")),
            "defense": g.get("defense", doc.get("defense")),
        }
        grid_seeds = _seeds(g["seeds"], where, table) if "seeds" in g else seeds
        counted += count_trials(merged, grid_seeds)
        _check_count(counted, where, table)  # all the grids so far, before this one expands
        trials += expand_grid(merged, where, table, name, grid_seeds, validated)
    return trials


def _set_params(doc: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """kind -> plugin name -> the parameter keys the (validated) file writes in its [[attack]] / [[defense]] tables,
    top level and grids."""
    out: dict[str, dict[str, set[str]]] = {}
    specs = [doc, *(g for g in doc.get("grid", []) if isinstance(g, dict))]
    for spec in specs:
        for kind in ("attack", "defense"):
            entries = spec.get(kind, [])
            for entry in [entries] if isinstance(entries, dict) else entries:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                    name = registry.resolve_name(kind, entry["name"])
                    out.setdefault(kind, {}).setdefault(name, set()).update(k for k in entry if k != "name")
    shown = {kind: {n: sorted(keys) for n, keys in names.items() if keys} for kind, names in out.items()}
    return {kind: names for kind, names in shown.items() if names}


def load_suite(path: str | Path, extra_tables: typing.Iterable[str] = (), overrides: typing.Sequence[str] = ()) -> Suite:
    """Parse, validate and expand a suite file. Raises InputError (one line) on any problem. overrides: `KEY=VALUE`
    settings applied over the file before it is validated (`gleak run --set`; gleak.orchestration.suite_overrides)."""
    path = Path(path)
    where = _Where(path)
    doc = _read_toml(path)
    if overrides:
        from gleak.orchestration.suite_overrides import apply_overrides

        doc = apply_overrides(doc, overrides, SUITE_KEYS)
    allowed = TOP_TABLES | set(extra_tables)
    for k in doc:
        if k not in allowed:
            raise where.error(k, None, f"unknown table{_close(k, allowed)} (tables: {', '.join(sorted(allowed))})")
    meta = doc.get("suite", {})
    if not isinstance(meta, dict):
        raise where.error("suite", None, "must be a table")
    for k in meta:
        if k not in SUITE_KEYS:
            raise where.error("suite", k, f"unknown key{_close(k, SUITE_KEYS)} (keys: {', '.join(sorted(SUITE_KEYS))})")
    name = meta.get("name", path.stem)
    problem = check_suite_name(name)
    if problem:
        raise where.error("suite", "name", problem)
    save_images = meta.get("save_images", True)
    if not isinstance(save_images, bool):
        raise where.error("suite", "save_images", f"must be true or false, got {save_images!r}")
    description = meta.get("description", "")
    if not isinstance(description, str):
        raise where.error("suite", "description", "must be a string")
    seeds = _seeds(meta.get("seeds", [0]), where, "suite")
    from gleak.mechanics.verdicts import VERDICT_RULES

    verdict = meta.get("verdict", "margin")
    if verdict not in VERDICT_RULES:
        raise where.error("suite", "verdict", f"must be one of {', '.join(map(repr, VERDICT_RULES))}, got {verdict!r}")
    from gleak.mechanics.device import check_name

    device = meta.get("device")
    if device is not None and check_name(device):
        raise where.error("suite", "device", check_name(device))

    threat = meta.get("threat_model")
    if threat is not None:
        from gleak.contracts.threat_model import parse

        try:
            threat = str(parse(threat))
        except ValueError as exc:
            raise where.error("suite", "threat_model", str(exc).removeprefix("threat_model ")) from None

    grids = doc.get("grid")
    trials: list[TrialConfig] = []
    if grids is None:
        trials = expand_grid(doc, where, "suite", name, seeds)
    else:
        trials = _grid_tables(doc, grids, where, name, seeds)
    unique: dict[str, TrialConfig] = {}
    for t in trials:
        t = dataclasses.replace(t, verdict=verdict, threat_model=threat)
        unique.setdefault(t.trial_id, t)  # asked for twice: runs once
    extras = {k: doc[k] for k in extra_tables if k in doc}
    utility = _utility(doc["utility"], where) if "utility" in doc and "utility" not in extra_tables else None
    claims = parse_claims(doc["claim"], where) if "claim" in doc and "claim" not in extra_tables else []
    return Suite(name, path, list(unique.values()), description, save_images, extras, utility, verdict, claims, device,
                 _set_params(doc))
