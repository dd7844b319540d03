"""Devices (gleak.mechanics.device, `gleak run --device`): resolved in one place, refused cleanly where absent, recorded per
trial, never part of a trial id. There is no GPU where these tests run: cuda is only ever refused here."""
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import gleak
from gleak.contracts.errors import InputError
from gleak.mechanics import device as devices

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = not torch.cuda.is_available()

SUITE = """
[suite]
name = "dev"
seeds = [0, 1]
{device}
[case]
dataset = "skimage"
model = "mlp"
model_params = {{ hidden = [16] }}
resolution = 8
batch_size = 1
[[attack]]
name = "closed-form"
[[defense]]
name = "none"
"""


def test_resolve_auto_cpu_and_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve("auto") == devices.resolve(None) == devices.resolve("cpu") == "cpu"
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(InputError, match="no CUDA device") as e:
            devices.resolve(spec)
        assert "\n" not in str(e.value) and str(e.value).startswith("--device:")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.resolve("auto") == devices.resolve("cuda") == "cuda:0" and devices.resolve("cuda:1") == "cuda:1"
    with pytest.raises(InputError, match="2 CUDA device"):
        devices.resolve("cuda:2")
    for bad in ("gpu", "cuda:x", "", 0, "cpu:0"):
        with pytest.raises(InputError, match="must be auto, cpu, cuda or cuda:N"):
            devices.resolve(bad)


def test_cpu_generator_draws_land_on_the_device_floats_only():
    """On a device other than the CPU, a plugin's draw from its CPU generator is made on the CPU (the same numbers as
    a CPU run) and a float result moved; integer draws stay on the CPU. The meta device stands in for a GPU."""
    g = torch.Generator().manual_seed(3)
    with devices.use("meta") as dev:
        assert devices.current() == dev
        x = torch.randn((2, 3), generator=g, dtype=torch.float64)
        perm = torch.randperm(5, generator=g)
        plain = torch.zeros(2)  # not a draw: untouched
    assert x.device.type == "meta" and x.dtype == torch.float64 and x.shape == (2, 3)
    assert perm.device.type == "cpu" and sorted(perm.tolist()) == [0, 1, 2, 3, 4]
    assert plain.device.type == "cpu" and devices.current().type == "cpu"
    # the generator advanced exactly as a CPU run's: the next draw is the CPU run's next draw
    ref = torch.Generator().manual_seed(3)
    torch.randn((2, 3), generator=ref, dtype=torch.float64), torch.randperm(5, generator=ref)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=ref))


def test_run_trial_cpu_and_auto_same_id_same_metrics_device_recorded(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    case = dict(dataset="skimage", model="mlp", model_params={"hidden": [16]}, resolution=8, batch_size=2)
    cpu = gleak.run_trial(attack={"name": "dlg", "iterations": 3, "max_iter": 2}, device="cpu", **case)
    auto = gleak.run_trial(attack={"name": "dlg", "iterations": 3, "max_iter": 2}, device="auto", **case)
    assert cpu.trial_id == auto.trial_id
    assert cpu.metrics == auto.metrics and cpu.extra["device"] == auto.extra["device"] == "cpu"
    with pytest.raises(InputError, match="no CUDA device") as e:
        gleak.run_trial(attack="closed-form", device="cuda", **case)
    # From Python the message names the Python argument and its fix, never the command line's flag.
    assert str(e.value).startswith("gleak.run_trial: device:") and "device='cpu'" in str(e.value)
    assert "--device" not in str(e.value)
    with pytest.raises(InputError) as e:
        gleak.run("quick", out="/nonexistent/never-written", device="cuda")
    assert str(e.value).startswith("gleak.run: device:") and "--" not in str(e.value)


@pytest.mark.skipif(not NO_CUDA, reason="refusing cuda is for machines without one")
def test_cli_refuses_cuda_where_absent_with_one_line_and_exit_2(tmp_path, capsys):
    from gleak.cli import main

    def run(*extra):
        code = main(["run", str(suite), "--out", str(tmp_path / "out"), "--no-progress", "--in-process", *extra])
        return code, capsys.readouterr().err

    suite = tmp_path / "dev.toml"
    suite.write_text(SUITE.format(device=""))
    code, err = run("--device", "cuda")
    assert code == 2 and err.count("\n") == 1 and "--device: cuda asked for" in err, err
    suite.write_text(SUITE.format(device='device = "cuda:0"'))  # the suite asks: the message names its file and key
    code, err = run()
    assert code == 2 and err.count("\n") == 1 and f"{suite}: [suite] device: cuda:0 asked for" in err, err
    suite.write_text(SUITE.format(device='device = "gpu"'))  # not a device name: refused at validation
    code, err = run()
    assert code == 2 and "device" in err and "'gpu'" in err, err
    assert not (tmp_path / "out").exists()


def test_cli_device_auto_records_the_device_and_keeps_the_cpu_ids(tmp_path):
    from gleak.cli import main

    suite = tmp_path / "dev.toml"
    suite.write_text(SUITE.format(device='device = "cpu"'))
    assert main(["run", str(suite), "--device", "auto", "--out", str(tmp_path / "auto"), "--no-progress", "--in-process"]) == 0
    df = pd.read_csv(tmp_path / "auto" / "results.csv")
    expected = "cuda:0" if not NO_CUDA else "cpu"
    assert [json.loads(e)["device"] for e in df["extra"]] == [expected] * 2
    from gleak.orchestration.suite import load_suite

    assert sorted(df["trial_id"]) == sorted(t.trial_id for t in load_suite(suite).trials)  # ids: the config's alone
