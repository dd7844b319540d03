"""A plugin that ends the process (os._exit, sys.exit) at import or in __init__ ends `run` and `check-plugin` with
one line naming the plugin and exit 2, not with its own exit status (gleak.contracts.plugin_guards.no_exit)."""
import signal
import subprocess
import textwrap
import time

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


STUBBORN = textwrap.dedent('''
    import subprocess
    import sys
    import time

    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("stubborn")
    class Stubborn(Attack):
        """Test attack that starts a child ignoring SIGTERM, then hangs past the trial's time limit."""

        needs = frozenset({"architecture"})

        def reconstruct(self, observation, rng):
            code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
            child = subprocess.Popen([sys.executable, "-c", code])
            with open(PIDS, "a") as fh:
                fh.write(f"{child.pid}\\n")
            time.sleep(300)
''')


def test_a_timed_out_trials_children_end_with_it(tmp_path, capsys):
    """The trial is killed at --trial-timeout: its worker and every process below it go (a child that ignores
    SIGTERM included; gleak.orchestration.workers._kill_tree), none is left running after the run."""
    from gleak import cli

    pids = tmp_path / "pids.txt"
    plugin = tmp_path / "stubborn.py"
    plugin.write_text(STUBBORN.replace("PIDS", repr(str(pids))))
    (tmp_path / "s.toml").write_text(T1.replace('name = "closed-form"', 'name = "stubborn"').replace("[0, 1]", "[0]"))
    code = cli.main(["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--plugin", str(plugin),
                     "--no-progress", "--trial-timeout", "3"])  # fmt: skip
    assert code == 1, capsys.readouterr().err
    spawned = [int(p) for p in pids.read_text().split()]
    assert len(spawned) == 1
    deadline = time.monotonic() + 5  # killed before the run returns; a zombie is reaped by init, not counted
    while _alive(spawned[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(spawned[0])


INTERRUPTER = textwrap.dedent('''
    import time

    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("interrupter")
    class Interrupter(Attack):
        """Test attack whose __init__ raises KeyboardInterrupt, or waits (for the user's Ctrl-C)."""

        needs = frozenset({"architecture"})

        def __init__(self):
            if WAIT:
                open(MARK, "w").close()
                time.sleep(60)
            raise KeyboardInterrupt

        def reconstruct(self, observation, rng):
            raise RuntimeError("never reached")
''')


def test_a_plugins_keyboard_interrupt_is_its_fault_and_a_ctrl_c_is_the_users(tmp_path, gleak_cmd, run_env, capsys):
    """KeyboardInterrupt raised by a plugin's __init__: exit 2, one line naming the plugin (not "interrupted");
    a real SIGINT while a plugin's __init__ runs: the user's interrupt, exit 130
    (gleak.contracts.plugin_guards.sigint_watch)."""
    from gleak import cli

    (tmp_path / "s.toml").write_text(T1.replace('name = "closed-form"', 'name = "interrupter"'))
    mark = tmp_path / "started"
    for wait in (False, True):
        plugin = tmp_path / f"interrupter_{wait}.py"
        plugin.write_text(INTERRUPTER.replace("WAIT", str(wait)).replace("MARK", repr(str(mark))))
        args = ["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / f"o{wait}"), "--plugin", str(plugin),
                "--no-progress", "--in-process"]  # fmt: skip
        if not wait:
            capsys.readouterr()
            assert cli.main(args) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and "attack 'interrupter'" in err and "KeyboardInterrupt" in err, err
            continue
        proc = subprocess.Popen(gleak_cmd + args, env=run_env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err)


THREADER = textwrap.dedent('''
    import threading
    import time

    from gleak import register_attack
    from gleak.contracts.plugin import Attack


    @register_attack("threader")
    class Threader(Attack):
        """Test attack that leaves a non-daemon thread running."""

        needs = frozenset({"architecture"})

        def reconstruct(self, observation, rng):
            threading.Thread(target=time.sleep, args=(120,), name="plugin-sleeper").start()
            raise RuntimeError("done threading")
''')


def test_in_process_run_exits_although_a_plugin_left_a_thread(tmp_path, gleak_cmd, run_env):
    """`--in-process` runs plugins in gleak's process; a non-daemon thread one leaves would keep Python from exiting
    (it waits for them): the command exits with the run's status and names the thread (gleak.cli.entry)."""
    plugin = tmp_path / "threader.py"
    plugin.write_text(THREADER)
    (tmp_path / "s.toml").write_text(T1.replace('name = "closed-form"', 'name = "threader"').replace("[0, 1]", "[0]"))
    t0 = time.monotonic()
    r = subprocess.run(gleak_cmd + ["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--plugin",
                                    str(plugin), "--no-progress", "--in-process"],  # fmt: skip
                       env=run_env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 1 and time.monotonic() - t0 < 100, r.stderr
    assert "plugin-sleeper" in r.stderr.strip().splitlines()[-1], r.stderr


LOOPER = textwrap.dedent('''
    import torch

    from gleak import Attack, Reconstruction, register_attack


    @register_attack("looper")
    class Looper(Attack):
        """Test attack that notes the iterations it is built with."""

        needs = frozenset({"batch_size"})

        def __init__(self, iterations: int = 7, restarts: int = 1):
            self.iterations, self.restarts = iterations, restarts
            with open(SEEN, "a") as fh:
                fh.write(f"{iterations}\\n")

        def reconstruct(self, observation, rng):
            k = observation.knowledge
            return Reconstruction(x=torch.zeros((k.batch_size, *k.input_shape)))
''')


def test_check_plugin_is_quick_by_default_and_says_so(tmp_path, gleak_cli):
    """A plugin without conformance_params is checked with its loop parameters cut (gleak.contracts.tags.QUICK:
    iterations 2), and the first line says so; --full checks it at its defaults. `restarts` at 1 is already quick."""
    seen = tmp_path / "seen.txt"
    plugin = tmp_path / "looper.py"
    plugin.write_text(LOOPER.replace("SEEN", repr(str(seen))))
    code, err = gleak_cli(["check-plugin", str(plugin)])
    assert code == 0, err
    assert set(seen.read_text().split()) == {"2"}
    seen.unlink()
    full = tmp_path / "looper_full.py"  # another name: this process has "looper" registered now
    full.write_text(LOOPER.replace("SEEN", repr(str(seen))).replace('"looper"', '"looper-full"'))
    code, err = gleak_cli(["check-plugin", str(full), "--full"])
    assert code == 0 and set(seen.read_text().split()) == {"7"}, err
