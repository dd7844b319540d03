"""Leaderboard files (Markdown, CSV, LaTeX, HTML) with utility beside privacy, the figures, and `gleak plot`."""
import base64
import csv
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from gleak.reporting.figures import pareto_front


@pytest.fixture(scope="module")
def out(utility_run):
    _, folder, _, env = utility_run
    return folder, env


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def test_pareto_front_marks_the_undominated_points():
    pts = [(90.0, 60.0), (85.0, 20.0), (80.0, 25.0), (70.0, 8.0), (85.0, 20.0), (60.0, 30.0)]
    # (80, 25) is beaten by (85, 20); (60, 30) by everything; equal points do not dominate each other
    assert pareto_front(pts) == [0, 1, 3, 4]


def test_every_format_carries_accuracy_and_epsilon(out):
    folder, _ = out
    rows = list(csv.DictReader((folder / "leaderboard.csv").open()))
    assert {"accuracy", "baseline_accuracy", "epsilon"} <= set(rows[0])
    dp = [r for r in rows if '"mode": "dp"' in r["defense_params"]]
    assert len(dp) == 1 and float(dp[0]["epsilon"]) > 0
    assert all(r["epsilon"] == "" for r in rows if r not in dp)
    tex = (folder / "leaderboard.tex").read_text()
    assert "Test accuracy" in tex and "Epsilon" in tex and "PSNR (dB)" in tex and not re.search(r"(?<!\\)_", tex.split("\\label")[0])
    assert "\\begin{table}" in tex and "\\caption{" in tex and "\\toprule" in tex  # a float ready for \input
    md = (folder / "leaderboard.md").read_text()
    assert "## Utility" in md and "## Each attack's best result against each defense" in md
    assert md.count("LPIPS is unavailable") == 1  # said once, as a footnote
    assert "figures/frontier.png" in md
    # A defense that an attack gets through is named in words, not only in the verdict column.
    broken = {r["defense"] for r in rows if r["verdict"] == "recovered" and r["defense"] != "none"}
    assert ("Broken: an attack recovers" in md) == bool(broken)
    assert all(f"{d} in " in md.split("Broken: ")[1].split("\n")[0] for d in broken)


def test_figures_are_written_by_run_and_by_plot(out, capsys):
    folder, env = out
    names = sorted(p.name for p in (folder / "figures").glob("*.png"))
    grid_name = "reconstructions_skimage_mlp_2_model_params_hidden_32_resolution_16.png"  # the case's own settings
    assert names == ["frontier.png", grid_name, "strength_noise_sigma.png",
                     "strength_topk_ratio.png", "utility_curves.png"], names  # fmt: skip
    for n in names:
        img = _png(folder / "figures" / n)
        assert img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 10, n  # drawn, not blank
    grid = _png(folder / "figures" / grid_name)
    shutil.rmtree(folder / "figures")
    r = subprocess.run([sys.executable, "-m", "gleak", "plot", str(folder)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (folder / "figures").glob("*.png")) == names
    assert np.array_equal(_png(folder / "figures" / grid_name), grid)
    from gleak.cli import main

    assert main(["plot", str(folder / "nope")]) == 2 and "nope: no such folder" in capsys.readouterr().err


class _Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs, self.hrefs, self.th, self.rows, self._in_th = [], [], [], [], 0, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag in ("img", "script", "iframe") and "src" in a:
            self.srcs.append(a["src"])
        if tag == "link" and "href" in a:
            self.hrefs.append(a["href"])
        self.rows += tag == "tr"
        self._in_th = tag == "th"

    def handle_endtag(self, tag):
        self._in_th = False if tag == "th" else self._in_th

    def handle_data(self, data):
        if self._in_th:
            self.th.append(data)


def test_html_is_self_contained(out):
    folder, _ = out
    dom = _Dom()
    dom.feed((folder / "leaderboard.html").read_text())
    assert dom.srcs and all(s.startswith("data:image/png;base64,") for s in dom.srcs) and not dom.hrefs
    for s in dom.srcs:  # every embedded figure decodes as a PNG
        assert base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"accuracy", "epsilon", "worst attack"} <= set(dom.th)


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (apt-get install -y chromium)")
def test_html_renders_in_headless_chromium(out, tmp_path):
    """Chromium's own DOM after loading the page (the tables with their rows, the figures decoded), and a screenshot
    that shows drawn content."""
    folder, _ = out
    page = (folder / "leaderboard.html").resolve().as_uri()
    flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run(flags + ["--virtual-time-budget=3000", "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<table") >= 5 and "<h2>Defenses, ranked by their worst case over attacks</h2>" in html
    ranking = html.split("<h2>Defenses, ranked by their worst case over attacks</h2>", 1)[1].split("</table>", 1)[0]
    assert len(re.findall(r"<tr>", ranking)) == 1 + 6  # header + six defense configurations
    assert html.count('<img src="data:image/png;base64,') >= 4
    shot = tmp_path / "shot.png"
    r = subprocess.run(flags + ["--window-size=1280,1600", f"--screenshot={shot}", page], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    img = _png(shot)
    assert img.shape[:2] == (1600, 1280)
    dark = (img.mean(axis=2) < 100).mean()  # text and table rules
    assert 0.002 < dark < 0.5 and len(np.unique(img.reshape(-1, 3), axis=0)) > 50, dark


@pytest.mark.parametrize("how", ["env", "flag"])
def test_a_named_lpips_backbone_that_is_missing_is_exit_2(tmp_path, run_env, how):
    root = Path(__file__).resolve().parent.parent
    env = dict(run_env)
    args = [sys.executable, "-m", "gleak", "run", "quick", "--out", str(tmp_path / "o"), "--no-progress"]
    if how == "env":
        env["GLEAK_LPIPS_BACKBONE"] = str(tmp_path / "alexnet.pth")
    else:
        args += ["--lpips-backbone", str(tmp_path / "alexnet.pth")]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "alexnet.pth" in lines[0] and "not" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


PARAMS_SUITE = """
[suite]
name = "defaults-named"
seeds = [0]
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [8] }
resolution = 8
[[attack]]
name = "closed-form"
[[defense]]
name = "none"
[[defense]]
name = "topk"
ratio = 0.9
"""


def test_a_parameter_the_suite_sets_to_its_default_is_named_with_its_value(tmp_path):
    """topk's default ratio is 0.9: written in the suite file, the leaderboard says 'ratio=0.9', not '-' (also from
    the committed files alone: suite.json keeps what the file set)."""
    from gleak.contracts.registry import plugin_info
    from gleak.orchestration.runner import run_suite
    from gleak.orchestration.suite import load_suite
    from gleak.reporting.report import write_reports

    assert plugin_info("defense", "topk").defaults()["ratio"] == 0.9  # else this test tests nothing
    (tmp_path / "s.toml").write_text(PARAMS_SUITE)
    suite = load_suite(tmp_path / "s.toml")
    assert suite.set_params == {"defense": {"topk": ["ratio"]}}
    run_suite(suite, tmp_path / "out", progress=False, in_process=True)
    write_reports(tmp_path / "out")
    md = (tmp_path / "out" / "leaderboard.md").read_text()
    assert re.search(r"\| topk\s+\| ratio=0\.9\s+\|", md), md
    assert "ratio=0.9" in (tmp_path / "out" / "leaderboard.tex").read_text()
    clone = tmp_path / "clone"  # a fresh clone: results.csv and suite.json, no store
    clone.mkdir()
    for f in ("results.csv", "suite.json"):
        shutil.copy(tmp_path / "out" / f, clone / f)
    write_reports(clone)
    assert re.search(r"\| topk\s+\| ratio=0\.9\s+\|", (clone / "leaderboard.md").read_text())


def test_a_case_label_names_its_own_settings_that_change_what_is_computed():
    """From the case alone: defaults unnamed, a setting that does nothing in this case (training steps of an
    untrained model, a server step without warm-up rounds) unnamed, the protocol left to the defense's name."""
    from gleak.contracts.config import CaseConfig
    from gleak.reporting.aggregate import case_variant

    base = CaseConfig(dataset="skimage", model="mlp").to_dict()
    assert case_variant(base) == "" and case_variant({**base, "resolution": None}) == ""
    assert case_variant({**base, "train_steps": 300, "server_lr": 0.01}) == ""
    assert case_variant({**base, "model_state": "trained", "train_steps": 300}) == "model_state=trained, train_steps=300"
    assert case_variant({**base, "rounds": 4, "server_lr": 0.01, "resolution": 16}) == "resolution=16, rounds=4, server_lr=0.01"
    assert case_variant({**base, "protocol": "fedavg", "clients": 4}) == "clients=4"


def test_the_first_screen_is_the_ranking_and_the_method_notes_come_last(out):
    """Before the defense ranking only the title, the suite's description and one short line; the empty LPIPS
    column is said right under the table; how the numbers are made comes after every table, as short notes."""
    folder, _ = out
    md = (folder / "leaderboard.md").read_text()
    head = md[: md.index("## Defenses, ranked by their worst case")]
    description = md.split("\n\n")[1]
    assert len(head) - len(description) < 400, head
    ranking = md[md.index("## Defenses, ranked"): md.index("\n## ", md.index("## Defenses, ranked") + 5)]
    assert "The LPIPS column is empty" in ranking
    method = md.index("## How the numbers are made")
    assert method > md.index("## Results by case") and md.index("## Notes") > method
    notes = md[method: md.index("## Notes")].splitlines()
    assert max(len(line) for line in notes) < 600  # short notes, not one paragraph


def test_a_parameter_left_out_of_a_stored_configuration_compares_as_its_default():
    """The reports name an attack's parameters that differ between its configurations; one a configuration leaves
    out (cocktail-party's authors-loss options under method "fastica") is its default there, not a difference."""
    import json

    import pandas as pd

    from gleak.contracts.registry import check_params
    from gleak.reporting.aggregate import varying_keys

    configs = [{}, {"iterations": 5000}, {"method": "fastica"}]
    df = pd.DataFrame({"attack": "cocktail-party",
                       "attack_params": [json.dumps(check_params("attack", "cocktail-party", c)) for c in configs]})  # fmt: skip
    assert varying_keys(df, "attack") == {"cocktail-party": {"iterations", "method"}}
