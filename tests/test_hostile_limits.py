"""Limits checked before work: a grid's size counted before it expands (gleak.orchestration.suite.count_trials), a foreign
--out refused without walking it (gleak.orchestration.output_folder.claim)."""
import textwrap
import tomllib
from pathlib import Path

import pytest

from gleak.contracts.errors import InputError
from gleak.orchestration import output_folder as owned
from gleak.orchestration import suite

BIG = textwrap.dedent('''
    [suite]
    name = "big"
    seeds = 100000
    [case]
    dataset = "uniform"
    model = "linear"
    batch_size = [1, 2]
    [[attack]]
    name = "closed-form"
    [[defense]]
    name = "noise"
    sigma = [0.1, 0.2, 0.3, 0.4, 0.5]
    [[defense]]
    name = "none"
''')


def _never_expanded(monkeypatch):
    def expanded(*a, **k):
        raise AssertionError("the grid was expanded before its size was checked")

    monkeypatch.setattr(suite, "_cases", expanded)


def test_a_huge_grid_is_refused_before_it_expands(tmp_path, monkeypatch):
    (tmp_path / "big.toml").write_text(BIG)
    _never_expanded(monkeypatch)
    with pytest.raises(InputError, match=r"expands to 1,200,000 trials, more than the 100,000") as e:
        suite.load_suite(tmp_path / "big.toml")
    assert "\n" not in str(e.value) and "big.toml" in str(e.value)


def test_grids_count_together(tmp_path, monkeypatch):
    """Two [[grid]] tables of 60,000 trials each: the second is refused before it expands."""
    grids = textwrap.dedent('''
        [suite]
        name = "g"
        seeds = 30000
        [case]
        dataset = "uniform"
        model = "linear"
        batch_size = [1, 2]
        [[attack]]
        name = "closed-form"
        [[defense]]
        name = "none"
        [[grid]]
        name = "a"
        [[grid]]
        name = "b"
    ''')
    (tmp_path / "g.toml").write_text(grids)
    assert suite.count_trials({"case": {"batch_size": [1, 2]}, "attack": {"name": "closed-form"},
                               "defense": [{"name": "none"}]}, list(range(30000))) == 60000  # fmt: skip
    calls = []
    real = suite.expand_grid
    monkeypatch.setattr(suite, "expand_grid", lambda spec, where, table, name, seeds, *a: calls.append(table)
                        or real(spec, where, table, name, [0], *a))  # fmt: skip
    with pytest.raises(InputError, match=r"grid #2 \(b\).*120,000 trials"):
        suite.load_suite(tmp_path / "g.toml")
    assert calls == ["grid #1 (a)"]


def test_the_count_follows_the_expansion_rules(tmp_path):
    """A list-typed parameter's list is one value; a list of lists expands; the count equals the trials built."""
    text = textwrap.dedent('''
        [suite]
        name = "s"
        seeds = [0, 1, 2]
        [case]
        dataset = "uniform"
        model = "mlp"
        batch_size = [1, 2]
        model_params = { hidden = [8] }
        [[attack]]
        name = "closed-form"
        [[attack]]
        name = "idlg"
        [[defense]]
        name = "noise"
        sigma = [0.1, 0.2]
    ''')
    (tmp_path / "s.toml").write_text(text)
    s = suite.load_suite(tmp_path / "s.toml")
    assert len(s.trials) == 2 * 2 * 2 * 3 == suite.count_trials(tomllib.loads(text), [0, 1, 2])


def test_a_foreign_out_is_refused_without_walking_it(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "deep" / "er").mkdir(parents=True)
    (home / "deep" / "er" / "x.txt").write_text("mine")
    (home / "notes.txt").write_text("mine")

    def walked(*a, **k):
        raise AssertionError("walked the folder")

    monkeypatch.setattr(owned.os, "walk", walked)
    with pytest.raises(InputError, match="not a gleak output folder .* and not empty"):
        owned.claim(home, False, lambda f: False)
    with pytest.raises(InputError, match="not empty"):
        owned.claim(Path("/"), False, lambda f: False)


def test_a_case_over_the_memory_bound_is_refused_before_any_data_is_built(tmp_path, monkeypatch):
    """resolution 1024 at batch 64: one line naming the file, the table and the key, before a data set is loaded
    (gleak.orchestration.suite.MAX_ROUND_VALUES); the same case at batch 8 is within the bound."""
    text = textwrap.dedent('''
        [suite]
        name = "mem"
        seeds = [0]
        [case]
        dataset = "uniform"
        model = "linear"
        resolution = 1024
        batch_size = BATCH
        [[attack]]
        name = "closed-form"
        [[defense]]
        name = "none"
        [[grid]]
        name = "big"
        case = { resolution = 1024, batch_size = 64, channels = 1 }
    ''')
    loaded = []

    def load(*a, **k):
        loaded.append(a)
        raise AssertionError("a data set was loaded before the memory bound was checked")

    monkeypatch.setattr(suite, "_check_data", load)
    (tmp_path / "mem.toml").write_text(text.replace("BATCH", "64").split("[[grid]]")[0])
    with pytest.raises(InputError, match=r"mem\.toml: \[case\] key 'resolution': resolution 1024 x 1024 x 3 channels "
                                         r"at batch_size 64 x 1 clients is 201,326,592 pixel values") as e:  # fmt: skip
        suite.load_suite(tmp_path / "mem.toml")
    assert "\n" not in str(e.value) and "33,554,432" in str(e.value) and not loaded
    (tmp_path / "grid.toml").write_text(text.replace("resolution = 1024\n", "").replace("BATCH", "1"))
    with pytest.raises(InputError, match=r"grid\.toml: \[grid #1 \(big\)\.case\] key 'resolution'.*67,108,864"):
        suite.load_suite(tmp_path / "grid.toml")
    assert suite.MAX_ROUND_VALUES == 2**25
    within = suite.CaseConfig(dataset="uniform", model="linear", resolution=1024, batch_size=8, channels=3)
    suite._check_memory([within], suite.Where(tmp_path / "x.toml"), "case")  # 25,165,824 values: within


HANGS = textwrap.dedent('''
    import time

    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("NAME")
    class Hangs(Attack):
        """Test attack whose __init__ never returns."""

        needs = frozenset({"architecture"})

        def __init__(self):
            try:
                BODY
            except Exception:  # a plugin that swallows every error still stops
                pass

        def reconstruct(self, observation, rng):
            raise RuntimeError("never reached")
''')


@pytest.mark.parametrize("name, body", [("hangs-sleeping", "time.sleep(1000)"), ("hangs-looping", "while True: pass")])
def test_a_plugin_whose_init_hangs_is_one_line_naming_it(tmp_path, monkeypatch, name, body):
    import time

    from gleak.contracts import registry

    (tmp_path / f"{name}.py").write_text(HANGS.replace("NAME", name).replace("BODY", body))
    registry.load_plugin_file(str(tmp_path / f"{name}.py"))
    (tmp_path / "s.toml").write_text(BIG.replace("seeds = 100000", "seeds = [0]").replace('"closed-form"', f'"{name}"'))
    import signal

    monkeypatch.setenv("GLEAK_PLUGIN_INIT_TIMEOUT", "0.5")
    runner_timer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's, where it uses a signal
    t0 = time.monotonic()
    with pytest.raises(InputError, match=rf"s\.toml: \[attack #1\]: attack '{name}': __init__ did not return within 0.5 s") as e:
        suite.load_suite(tmp_path / "s.toml")
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value) and "GLEAK_PLUGIN_INIT_TIMEOUT" in str(e.value)
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    assert (left > 0) if runner_timer else (left == 0)  # no timer of its own left behind; the runner's kept
    monkeypatch.setenv("GLEAK_PLUGIN_INIT_TIMEOUT", "soon")
    with pytest.raises(InputError, match="GLEAK_PLUGIN_INIT_TIMEOUT must be a number of seconds > 0"):
        suite.load_suite(tmp_path / "s.toml")


COUNTED = textwrap.dedent('''
    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("counted")
    class Counted(Attack):
        """Test attack that notes each construction."""

        needs = frozenset({"architecture"})

        def __init__(self, k: int = 1):
            self.k = k
            with open(BUILT, "a") as fh:
                fh.write(f"{k}\\n")

        def reconstruct(self, observation, rng):
            raise RuntimeError("never run")
''')


def test_grids_sharing_the_files_plugins_build_each_configuration_once(tmp_path):
    """A suite validates each plugin configuration once before its grids expand (gleak.orchestration.suite,
    `validated`): three grids sharing the file's [[attack]] table build each of its two points once, not three times."""
    from gleak.contracts.registry import load_plugin_file

    built = tmp_path / "built.txt"
    plugin = tmp_path / "counted.py"
    plugin.write_text(COUNTED.replace("BUILT", repr(str(built))))
    load_plugin_file(plugin)
    (tmp_path / "s.toml").write_text(textwrap.dedent('''
        [suite]
        name = "once"
        seeds = [0]
        [case]
        dataset = "uniform"
        model = "linear"
        [[attack]]
        name = "counted"
        k = [1, 2]
        [[defense]]
        name = "none"
        [[grid]]
        case = { batch_size = 1 }
        [[grid]]
        case = { batch_size = 2 }
        [[grid]]
        case = { batch_size = 3 }
    '''))
    s = suite.load_suite(tmp_path / "s.toml")
    assert len(s.trials) == 6
    assert sorted(built.read_text().split()) == ["1", "2"]
