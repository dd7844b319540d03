"""Property-based fuzzing of `gleak run` against an existing output folder (issue 15).

Generated suites start from a valid one and get one to three mutations: a key set in a random table (known keys and
made-up ones) to a random value (NaN, infinities, huge and negative integers, strings with path characters, NUL,
'$' and HTML, lists, tables, booleans), a table replaced by a non-table, or the file's bytes damaged (not UTF-8,
truncated). Properties: the exit status is 0, 1 or 2; no traceback ever; on 2 one line, and the output folder is
byte-identical. The CLI's `main` is called in this process (`--in-process`): an example costs milliseconds when it
is refused, about a second when it runs. The number of examples is bounded for CI; the counts of what was tried
are printed at the end (run with -s to see them).
"""
import contextlib
import hashlib
import io
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gleak import cli

BASE = {
    "suite": {"name": "fz", "save_images": False},
    "case": {"dataset": "uniform", "model": "linear"},
    "attack": [{"name": "closed-form"}],
    "defense": [{"name": "none"}],
}
KEYS = {
    "suite": ["name", "seeds", "description", "save_images"],
    "case": ["dataset", "model", "batch_size", "clients", "resolution", "channels", "warmup_rounds", "local_steps",
             "local_lr", "train_lr", "model_params", "data_root", "dtype", "seed"],
    "attack": ["name", "iterations", "lr", "restarts", "tv", "rows"],
    "defense": ["name", "sigma", "ratio", "clip", "noise_multiplier", "mode"],
    "utility": ["dataset", "model", "training_rounds", "clients", "batch_size", "lr", "server_lr", "client_lr", "algorithm",
                "delta", "seed"],
}  # fmt: skip
TRIED: Counter = Counter()

values = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e308, 5e-324]),
    st.sampled_from([0, -1, -(2**63), 2**63, 2**64, 10**30, 1, 2, 7, 65537]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["..", ".", "/", "../../x", "a/b", "\x00", "a\x00b", "$x$", "$\\frac{", "<b>x</b>", "|", "n" * 300,
                     "mlp", "none", "closed-form", "noise", "uniform", "float64", "", "\\", "C:\\x", "~", "\n"]),
    st.text(max_size=12),
    st.booleans(),
    st.lists(st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.sampled_from(["hidden", "width", "x", "name"]), st.one_of(st.integers(-3, 10**9), st.lists(st.integers(-3, 10**6), max_size=2)), max_size=2),
)  # fmt: skip


@st.composite
def mutation(draw):
    kind = draw(st.sampled_from(["set", "set", "set", "set", "unknown-key", "table-not-table", "new-table", "grid", "bytes"]))
    table = draw(st.sampled_from(list(KEYS)))
    if kind in ("set", "unknown-key"):
        key = draw(st.sampled_from(KEYS[table])) if kind == "set" else draw(st.text(min_size=1, max_size=8))
        return (kind, table, key, draw(values))
    if kind == "table-not-table":
        return (kind, draw(st.sampled_from(["suite", "case", "attack", "defense", "utility"])), None, draw(values))
    if kind == "new-table":
        return (kind, draw(st.text(min_size=1, max_size=6)), None, draw(values))
    if kind == "grid":
        return (kind, "grid", draw(st.sampled_from(["case", "seeds", "attack", "defense", "name", "zz"])), draw(values))
    return (kind, None, draw(st.sampled_from(["latin-1", "truncate", "nul"])), None)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are TOML's (\uXXXX for control characters)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(type(v))


def to_toml(doc: dict) -> str:
    lines = []
    for table, body in doc.items():
        t = json.dumps(table)
        if isinstance(body, list) and all(isinstance(e, dict) for e in body):
            for e in body:
                lines.append(f"[[{t}]]")
                lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in e.items()]
        elif isinstance(body, dict):
            lines.append(f"[{t}]")
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in body.items()]
        else:
            lines.insert(0, f"{t} = {_toml_value(body)}")  # a top-level key: before any table
    return "\n".join(lines) + "\n"


def apply(muts) -> bytes:
    doc = json.loads(json.dumps(BASE))
    damage = None
    for kind, table, key, value in muts:
        TRIED[kind] += 1
        if kind in ("set", "unknown-key"):
            TRIED["value:" + type(value).__name__ + (":nonfinite" if isinstance(value, float) and not math.isfinite(value) else "")] += 1
            body = doc.setdefault(table, {})
            if isinstance(body, list):
                body = body[0]
            if isinstance(body, dict):
                body[key] = value
        elif kind in ("table-not-table", "new-table"):
            doc[table] = value
        elif kind == "grid":
            doc["grid"] = [{key: value}]
        else:
            damage = key
    text = to_toml(doc).encode()
    if damage == "latin-1":
        text += "# caf\xe9\n".encode("latin-1")
    elif damage == "truncate":
        text = text[: len(text) // 2]
    elif damage == "nul":
        text = text.replace(b"\n", b"\x00\n", 1)
    return text


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzbase")
    (d / "s.toml").write_text(to_toml(BASE))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main(["run", str(d / "s.toml"), "--out", str(d / "out"), "--no-progress", "--in-process"])
    assert code == 0, err.getvalue()
    yield d / "out"
    print(f"\nfuzz: {sum(TRIED[k] for k in ('exit 0', 'exit 1', 'exit 2'))} examples; tried: {dict(sorted(TRIED.items()))}")


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(muts=st.lists(mutation(), min_size=1, max_size=3))
def test_generated_suites_exit_0_1_or_2_without_traceback_and_2_changes_nothing(base_folder, tmp_path_factory, muts):
    work = tmp_path_factory.mktemp("fz")
    out = work / "out"
    shutil.copytree(base_folder, out)
    suite = work / "fz.toml"
    suite.write_bytes(apply(muts))
    before = digest(out)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["run", str(suite), "--out", str(out), "--no-progress", "--in-process"])
    TRIED[f"exit {code}"] += 1
    text = err.getvalue()
    assert code in (0, 1, 2), text
    assert "Traceback" not in text, text
    if code == 2:
        assert len(text.strip().splitlines()) == 1, text
        assert digest(out) == before
    shutil.rmtree(work)
