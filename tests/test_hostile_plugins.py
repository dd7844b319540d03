"""A plugin that ends the process (os._exit, sys.exit) at import or in __init__ ends `run` and `check-plugin` with
one line naming the plugin and exit 2, not with its own exit status (gleak.contracts.attack_output.no_exit)."""
import subprocess
import textwrap

import pytest

from tests.test_hostile_store import T1

PLUGIN = textwrap.dedent('''
    import os
    import sys

    from gleak import register_attack
    from gleak.contracts.plugin import Attack

    {at_import}


    @register_attack("exiter")
    class Exiter(Attack):
        """Test attack that ends its process."""

        needs = frozenset({{"architecture"}})

        def __init__(self):
            {in_init}

        def reconstruct(self, observation, rng):
            raise RuntimeError("never reached")
''')


def _exit_code_and_err(args, gleak_cmd, run_env, in_process, capsys):
    if in_process:  # sys.exit raises: safe to try in this process (os._exit would end the test run)
        from gleak import cli

        capsys.readouterr()
        return cli.main(args), capsys.readouterr().err
    r = subprocess.run(gleak_cmd + args, env=run_env, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stderr


@pytest.mark.parametrize("call", ["os._exit(7)", "sys.exit(7)"])
@pytest.mark.parametrize("where", ["import", "init"])
def test_a_plugin_ending_the_process_is_one_line_naming_it(tmp_path, gleak_cmd, run_env, capsys, call, where):
    plugin = tmp_path / f"exiter_{where}_{call[:3]}.py"
    plugin.write_text(PLUGIN.format(at_import=call if where == "import" else "", in_init=call if where == "init" else "pass"))
    (tmp_path / "s.toml").write_text(T1.replace('name = "closed-form"', 'name = "exiter"'))
    args = ["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--plugin", str(plugin), "--no-progress",
            "--in-process"]  # fmt: skip
    code, err = _exit_code_and_err(args, gleak_cmd, run_env, call.startswith("sys"), capsys)
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1 and f"called {call}" in err, err
    assert (plugin.name if where == "import" else "attack 'exiter'") in err
    assert not (tmp_path / "o").exists()
    if where == "import" and call.startswith("os"):
        code, err = _exit_code_and_err(["check-plugin", str(plugin)], gleak_cmd, run_env, False, capsys)
        assert code == 2 and plugin.name in err and f"called {call}" in err, (code, err)


SPAWNS = textwrap.dedent('''
    import subprocess
    import sys

    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("spawner")
    class Spawner(Attack):
        """Test attack that leaves processes behind: a child, and a grandchild its shell double-forks."""

        needs = frozenset({"architecture"})

        def reconstruct(self, observation, rng):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            shell = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
            with open(PIDS, "a") as fh:
                fh.write(f"{child.pid} {shell.stdout.strip()}\\n")
            raise RuntimeError("done spawning")
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_plugins_child_processes_end_with_its_trial(tmp_path, capsys):
    """Run in a worker process (the default): after each trial, and so after the run, no process the plugin
    started is left (gleak.orchestration.workers._end_trial_children), its double-forked grandchild included."""
    from gleak import cli

    pids = tmp_path / "pids.txt"
    plugin = tmp_path / "spawner.py"
    plugin.write_text(SPAWNS.replace("PIDS", repr(str(pids))))
    (tmp_path / "s.toml").write_text(T1.replace('name = "closed-form"', 'name = "spawner"'))
    code = cli.main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--plugin", str(plugin), "--no-progress"])
    assert code == 1, capsys.readouterr().err  # the trials failed on purpose, after spawning
    spawned = [int(p) for line in pids.read_text().splitlines() if line for p in line.split()]
    assert len(spawned) == 4, spawned  # two trials, two processes each
    assert [p for p in spawned if _alive(p)] == []
