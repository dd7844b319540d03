"""Plugin and suite text is data: Markdown leaderboards show it as written and never as structure (no link, no
image, no heading, no table cell, no HTML, no ESC byte), HTML escapes it, and the terminal output of `show`,
`list suites` and `check-plugin` carries no escape sequence (gleak.reporting.documents.markdown.md_data, gleak.contracts.escaping)."""
import re
import textwrap

from gleak import cli
from gleak.contracts.escaping import strip_controls
from gleak.reporting.documents.cells import data
from gleak.reporting.documents.html import render_html
from gleak.reporting.documents.markdown import md_escape, render_markdown

HOSTILE = "[click](javascript:alert(1)) ![t](http://example.invalid/t.png) <script>x</script> | a | `c` \x1b[31mred\x1b[0m"


def test_data_in_every_kind_of_block_is_shown_not_rendered(tmp_path):
    doc = [("h1", f"Leaderboard: {data(HOSTILE)}"), ("p", data("# heading\n> quote\n[ref]: http://x\n" + HOSTILE)),
           ("table", ["attack", "psnr"], [[data(HOSTILE), "12.5 (recovered)"], [data("a\nb|c"), "1.0 ± 0.1 [0.9, 1.1]"]]),
           ("list", [f"{data(HOSTILE)} ran 2 iterations"]), ("p", f"on `{data('m`x')}` and `gleak run`")]  # fmt: skip
    md = render_markdown(doc)
    assert "\x1b" not in md and "<script" not in md and "&lt;script>" in md
    assert "](" not in md.replace("\\](", "") and "![" not in md.replace("!\\[", "")  # no link, no image
    assert "\\[click\\]\\(javascript:alert\\(1\\)\\)" in md and "\\!\\[t\\]" in md
    lines = md.splitlines()
    assert not any(re.match(r"#+ heading", ln) for ln in lines) and "\\# heading" in md  # no heading from data
    assert "&gt; quote" in md and "\\[ref\\]: http://x" in md  # no quote, no link definition
    rows = [ln for ln in lines if ln.startswith("|")]
    assert len(rows) == 4 and all(len(re.findall(r"(?<!\\)\|", r)) == 3 for r in rows), rows  # 2 cells a row, still
    assert "\\`c\\`" in md and "on `m'x` and `gleak run`" in md  # no code span from data, none broken out of
    assert "12.5 (recovered)" in md and "1.0 ± 0.1 [0.9, 1.1]" in md  # gleak's own text as it was
    page = render_html(doc, tmp_path)
    assert "\x1b" not in page and "<script>" not in page and "\ue000" not in page and "\ue001" not in page
    assert "&lt;script&gt;" in page and "[click](javascript:alert(1))" in page  # escaped, shown as written


def test_gleak_text_without_data_is_unchanged_and_data_that_makes_nothing_stays_as_written():
    """The committed leaderboards stay byte for byte: gleak's own text is escaped as before, and a suite's brackets
    and parentheses that make no link ("U[0,1]", "the [utility] seed", "(Fig. 3(a))", "a < b", "x >= 2") stay."""
    own = "Written by `gleak run`; MSE < 0.03 and <b>x</b> & &amp; (median) [95%]"
    assert md_escape(own) == "Written by `gleak run`; MSE < 0.03 and &lt;b>x&lt;/b> & &amp;amp; (median) [95%]"
    for text in ("U[0,1], float64", "the [utility] seed (Fig. 3(a))", "a < b, iterations >= 2", "U[0.001, 0.1]: delta"):
        assert md_escape(f"x {data(text)} y") == f"x {text} y"
    assert md_escape(data("say [hi](x)")) == "say \\[hi\\]\\(x\\)"
    assert md_escape(f"ends with ]{data('(x)')}") == "ends with ]\\(x\\)"  # a link across gleak's text and the data


PLUGIN = textwrap.dedent('''
    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("marker")
    class Marker(Attack):
        """Test attack \\x1b[2J\\x1b]0;pwned\\x07 whose text [click](javascript:alert(1)) is hostile.

        More \\x1b[31mred\\x1b[0m text.
        """

        needs = frozenset({"architecture"})

        def __init__(self, note: str = "\\x1b[31m![t](http://example.invalid/t.png)"):
            self.note = note

        def reconstruct(self, observation, rng):
            raise RuntimeError("[click](javascript:alert(1)) | cell | \\x1b[2J <img src=x onerror=alert(1)>")
''')
SUITE = textwrap.dedent('''
    [suite]
    name = "esc"
    seeds = [0]
    description = """# Not a heading [click](javascript:alert(1)) \\u001b[2J
    | not | a | table |
    """
    [case]
    dataset = "uniform"
    model = "linear"
    [[attack]]
    name = "marker"
    note = "[x](javascript:alert(2)) \\u001b[31m"
    [[defense]]
    name = "none"
''')


def _plugin(tmp_path, name):
    """The hostile plugin under its own name (a name is registered once per process)."""
    (tmp_path / f"{name}.py").write_text(PLUGIN.replace("marker", name).replace("class Marker", f"class {name.title()}"))
    return tmp_path / f"{name}.py"


def test_a_hostile_plugin_and_suite_in_the_written_leaderboards(tmp_path, capsys):
    _plugin(tmp_path, "marker")
    (tmp_path / "esc.toml").write_text(SUITE)
    out = tmp_path / "o"
    code = cli.main(["run", str(tmp_path / "esc.toml"), "--out", str(out), "--plugin", str(tmp_path / "marker.py"),
                     "--no-progress", "--in-process"])  # fmt: skip
    assert code == 1, capsys.readouterr().err  # its trial failed, with the hostile error stored
    md = (out / "leaderboard.md").read_text()
    assert "\x1b" not in md and "<img" not in md and "&lt;img" in md
    assert "](" not in md.replace("\\](", "") and "javascript:alert" in md
    assert not re.search(r"(?m)^#+ Not a heading", md) and not re.search(r"(?m)^\| not \| a \|", md)
    failed = md[md.index("## Failed trials"):]
    row = next(ln for ln in failed.splitlines() if ln.startswith("| marker"))
    assert len(re.findall(r"(?<!\\)\|", row)) == 5, row  # 4 cells: the error's pipes are not cells
    page = (out / "leaderboard.html").read_text()
    assert "\x1b" not in page and "<img src=x" not in page


def test_terminal_output_carries_no_escape_sequence(tmp_path, capsys, monkeypatch):
    capsys.readouterr()
    assert cli.main(["show", "attack", "shown", "--plugin", str(_plugin(tmp_path, "shown"))]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "Test attack" in shown and "More red text." in shown
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "evil.toml").write_text('[suite]\nname = "evil"\ndescription = "Evil \\u001b]0;pwned\\u0007 suite \\u001b[2J"\n')
    monkeypatch.chdir(tmp_path)
    assert cli.main(["list", "suites"]) == 0
    listed = capsys.readouterr().out
    assert "\x1b" not in listed and "\x07" not in listed and "evil                 Evil  suite" in listed


def test_strip_controls_removes_escape_sequences_keeps_text():
    assert strip_controls("a\x1b[31mred\x1b[0m b\x1b]0;title\x07c\x1b]8;;http://x\x1b\\d\x07e\x9b\x7f\r\n\tf") == "ared bcde\n\tf"


def test_check_plugin_output_is_stripped(tmp_path, capsys, monkeypatch):
    """check-plugin quotes the plugin's own errors in its details: printed without escape sequences (the checks
    themselves replaced by one failing check that quotes such an error: the printing is what is tested here)."""
    from types import SimpleNamespace

    from gleak.orchestration import workers

    failing = SimpleNamespace(passed=False, name="reconstruct runs", detail="RuntimeError: \x1b[2J\x1b]0;pwned\x07boom")
    monkeypatch.setattr(workers, "check_plugin_isolated", lambda *a, **k: [failing])
    capsys.readouterr()
    assert cli.main(["check-plugin", str(_plugin(tmp_path, "checked"))]) == 1
    out = capsys.readouterr().out
    assert "attack checked:" in out and "FAIL  reconstruct runs (RuntimeError: boom)" in out
    assert "\x1b" not in out and "\x07" not in out


def test_csv_cells_that_a_spreadsheet_would_run_are_quoted_numbers_are_not():
    import pandas as pd

    from gleak.reporting.documents.tables import csv_text, quoted_cell, unquoted, unquoted_cell

    for text in ("=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx", "'=already", "''+two"):
        assert quoted_cell(text) == "'" + text and unquoted_cell(quoted_cell(text)) == text
    for kept in ("-1.5", "-inf", "+2", "1e-3", "plain", "'quoted but harmless", "", "a=b"):
        assert quoted_cell(kept) == kept and unquoted_cell(kept) == kept
    for number in (-1.5, float("-inf"), -3, None):
        assert quoted_cell(number) is number or quoted_cell(number) == number
    frame = pd.DataFrame({"attack": ["=cmd|' /C calc'!A0", "ok"], "psnr": [-1.5, float("-inf")], "error": ["-x", None]})
    text = csv_text(frame)
    assert "'=cmd|" in text and "'-x" in text and "-1.5" in text and "-inf" in text and "'-1.5" not in text
    import io

    back = unquoted(pd.read_csv(io.StringIO(text)).astype(object))
    assert back.loc[0, "attack"] == frame.loc[0, "attack"] and back.loc[0, "error"] == "-x"


def test_results_csv_of_a_run_quotes_a_formula_and_rebuilds_it_unchanged(tmp_path, capsys):
    """A plugin whose error starts with '=': results.csv quotes it; the published folder (csv only) rebuilds the
    same results.csv, and gleak.results reads the error as the store holds it."""
    import gleak

    plugin = tmp_path / "formula.py"
    plugin.write_text(textwrap.dedent('''
        from gleak import register_attack
        from gleak.contracts.plugin import Attack


        @register_attack("spreadsheet-cell")
        class Formula(Attack):
            """Test attack whose error is a spreadsheet formula."""

            needs = frozenset({"architecture"})

            def reconstruct(self, observation, rng):
                raise ValueError("boom")
    '''))
    (tmp_path / "f.toml").write_text(SUITE.replace('name = "marker"\nnote = "[x](javascript:alert(2)) \\u001b[31m"', 'name = "spreadsheet-cell"'))
    out = tmp_path / "o"
    assert cli.main(["run", str(tmp_path / "f.toml"), "--out", str(out), "--plugin", str(plugin), "--no-progress", "--in-process"]) == 1
    import sqlite3

    con = sqlite3.connect(out / "results.sqlite")
    with con:
        con.execute("UPDATE trials SET error = '=HYPERLINK(\"http://x\",\"y\")'")
    con.close()
    assert cli.main(["leaderboard", str(out)]) == 0
    csv = (out / "results.csv").read_text()
    assert ",\"'=HYPERLINK(" in csv, csv
    stored = gleak.results(out)["error"].tolist()
    (out / "results.sqlite").unlink()
    assert gleak.results(out)["error"].tolist() == stored == ['=HYPERLINK("http://x","y")']
    assert cli.main(["leaderboard", str(out)]) == 0
    assert (out / "results.csv").read_text() == csv  # rebuilt from itself: one quote, not one more each time


def test_figures_of_a_hostile_parameter_print_no_control_character(tmp_path, capfd):
    # a parameter holding ESC and BEL reaches the figures' labels; matplotlib's missing-glyph warning must not
    # carry it to the terminal
    import warnings

    (tmp_path / "glyph.py").write_text(textwrap.dedent('''
        import torch
        from gleak import register_attack
        from gleak.contracts.plugin import Attack
        from gleak.contracts.wire import Reconstruction


        @register_attack("glyph")
        class Glyph(Attack):
            """Test attack whose parameter is hostile text."""

            needs = frozenset({"architecture"})

            def __init__(self, note: str = "plain"):
                self.note = note

            def reconstruct(self, observation, rng):
                return Reconstruction(x=torch.zeros((1, *observation.knowledge.input_shape)))
    '''))
    (tmp_path / "g.toml").write_text('[suite]\nname = "g"\nseeds = [0, 1]\n[case]\ndataset = "uniform"\nmodel = "linear"\n'
                                     '[[attack]]\nname = "glyph"\nnote = ["a \\u001b[31m\\u0007 b", "c"]\n'
                                     '[[defense]]\nname = "noise"\nsigma = [0.01, 0.1]\n')  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = cli.main(["run", str(tmp_path / "g.toml"), "--out", str(tmp_path / "o"), "--plugin", str(tmp_path / "glyph.py"),
                         "--no-progress", "--in-process"])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 0, err
    assert list((tmp_path / "o" / "figures").glob("*.png"))
    assert "\x1b" not in err and "\x07" not in err
    assert not [w for w in seen if "\x1b" in str(w.message) or "\x07" in str(w.message)]
