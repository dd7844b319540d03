"""Fuzz: any value in a stored row's field, any bytes in a published folder's suite.json or results.csv: `gleak
leaderboard` never raises a traceback; it either rebuilds (the value is one gleak could have written) or exits 2
with one line and leaves the folder byte-identical."""
import shutil
import sqlite3
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gleak import cli
from tests.test_hostile_store import t1, tree  # noqa: F401 - t1: the shared fixture

FIELDS = ["extra", "attack_params", "defense_params", "case", "config", "mse", "psnr", "ssim", "cosine", "lpips",
          "label_acc", "grad_dist", "matched", "seconds", "verdict", "status", "image"]  # fmt: skip
META = ["suite", "description", "verdict", "claims", "utility"]
JSONISH = st.sampled_from(['{', '[]', '[1]', '"x"', '5', 'null', '{"a": [1]}', '{}', 'true', '[{}]', '1e999', "NaN"])
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), st.binary(max_size=30), JSONISH)
# Few examples, no shrinking: seconds, not minutes (a failure prints its unshrunk example, enough to reproduce).
FAST = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                phases=[Phase.explicit, Phase.generate])


def _leaderboard(folder: Path, capsys) -> None:
    before = tree(folder)
    capsys.readouterr()
    code = cli.main(["leaderboard", str(folder)])  # anything but InputError/OSError would escape: the test fails
    err = capsys.readouterr().err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("gleak: error: "), err
        assert tree(folder) == before


@FAST
@given(field=st.sampled_from(FIELDS + [f"meta.{k}" for k in META]), value=VALUES)
def test_any_value_in_a_stored_field(t1, capsys, field, value):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "o"
        shutil.copytree(t1, out)
        con = sqlite3.connect(out / "results.sqlite")
        with con:
            if field.startswith("meta."):
                con.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (field[5:], value))
            else:
                con.execute(f'UPDATE trials SET "{field}" = ?', (value,))
        con.close()
        _leaderboard(out, capsys)


def _edit(text: bytes, data) -> bytes:
    how = data.draw(st.sampled_from(["bytes", "cut", "insert", "line"]))
    if how == "bytes":
        return data.draw(st.binary(max_size=200))
    at = data.draw(st.integers(0, len(text)))
    if how == "cut":
        return text[:at]
    if how == "insert":
        return text[:at] + data.draw(st.binary(min_size=1, max_size=20)) + text[at:]
    return text + data.draw(st.text(max_size=80)).encode("utf-8", "surrogatepass") + b"\n"


@FAST
@given(name=st.sampled_from(["suite.json", "results.csv"]), data=st.data())
def test_any_bytes_in_a_published_folder(t1, capsys, name, data):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "o"
        shutil.copytree(t1, out)
        for f in ("results.sqlite", ".lock"):
            (out / f).unlink(missing_ok=True)
        (out / name).write_bytes(_edit((out / name).read_bytes(), data))
        _leaderboard(out, capsys)
