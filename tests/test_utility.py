"""Utility runs: federated training under a defense, against the same training without it (gleak.orchestration.utility)."""
import csv
import dataclasses
import json
import re
import sqlite3
from pathlib import Path

import pytest
import torch

import gleak
from gleak.contracts.config import UtilityConfig
from gleak.contracts.errors import InputError
from gleak.contracts.plugin import Defense
from gleak.mechanics.data import FASHION_MNIST_DEFAULT
from gleak.mechanics.protocol import Protocol as BaseProtocol
from gleak.orchestration.suite import load_suite
from gleak.orchestration.utility import federated_training, load_utility_data, run_utility, utility_setup

ROOT = Path(__file__).resolve().parent.parent
HAS_FMNIST = (FASHION_MNIST_DEFAULT / "train-images-idx3-ubyte.gz").is_file()
needs_fmnist = pytest.mark.skipif(not HAS_FMNIST, reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
UTILITY_CONTRACT = ["defense", "defense_params", "dataset", "model", "accuracy", "baseline_accuracy", "epsilon", "seconds"]
TINY = UtilityConfig(dataset="skimage", model="mlp", model_params={"hidden": [32], "activation": "relu"}, clients=2,
                     training_rounds=6, batch_size=8, server_lr=0.1)  # fmt: skip


@gleak.register_defense("test-counting")
class Counting(Defense):
    """Test defense: counts transforms and resets (class-level, so that every client's instance adds up)."""

    calls = {"transform": 0, "reset": 0}

    def reset(self):
        Counting.calls["reset"] += 1

    def transform(self, update, rng):
        Counting.calls["transform"] += 1
        return update


@gleak.register_protocol("test-protocol", as_defense=True)
class Protocol(BaseProtocol):
    """Test protocol that trains itself (as CGD does), named as a defense: the federated loop must not run."""

    rounds = 0

    def client_update(self, model, batch, defense, rng):
        Protocol.rounds += 1
        return super().client_update(model, batch, defense, rng)

    def train_utility(self, config, train, test, rng, defense=("none", {}), on_round=None):
        return {"accuracy": 0.5 + 0.01 * config.seed, "epsilon": 3.0, "participants": len(train)}


def test_the_defense_transforms_every_clients_update_every_round():
    Counting.calls.update(transform=0, reset=0)
    for algorithm, steps in (("fedsgd", 1), ("fedavg", 3)):
        cfg = dataclasses.replace(TINY, algorithm=algorithm, local_steps=steps, clients=3, training_rounds=4)
        train, test = load_utility_data(cfg)
        setup = utility_setup(cfg, "test-counting", {})
        protocol = gleak.create("protocol", setup.protocol, **setup.protocol_params)
        federated_training(cfg, protocol, (setup.defense, setup.defense_params), train, test)
    assert Counting.calls == {"transform": 2 * 3 * 4, "reset": 2 * 3}


@gleak.register_defense("test-alive")
class Alive(Defense):
    """Test defense: how many updates of rounds before the previous one are still alive when it transforms one."""

    refs: list = []
    most_alive = 0

    def transform(self, update, rng):
        import weakref

        older = Alive.refs[: max(0, len(Alive.refs) - 2)]  # this client's and the other's of the previous round
        Alive.most_alive = max(Alive.most_alive, sum(r() is not None for r in older))
        Alive.refs.append(weakref.ref(update))
        return update


def test_a_utility_run_lets_each_rounds_updates_go():
    # A 1,000-round run that kept every round's models and updates was killed for memory (12.6 GB): the loop keeps
    # rounds only when it observes them.
    Alive.refs.clear()
    Alive.most_alive = 0
    cfg = dataclasses.replace(TINY, training_rounds=8)
    train, test = load_utility_data(cfg)
    protocol = gleak.create("protocol", "fedsgd")
    federated_training(cfg, protocol, ("test-alive", {}), train, test)
    assert len(Alive.refs) == 2 * 8 and Alive.most_alive <= 2  # at most one more round's, never all of them


def test_a_utility_worker_that_dies_is_a_failed_row_and_the_run_goes_on():
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from gleak.orchestration.utility import _result_or_failed

    fut = Future()
    fut.set_exception(BrokenProcessPool("gone"))
    row = _result_or_failed(fut)
    assert row["status"] == "failed" and row["error"].startswith("WorkerDied")
    ok = Future()
    ok.set_result({"status": "ok", "accuracy": 0.5})
    assert _result_or_failed(ok)["accuracy"] == 0.5


def test_a_run_is_a_function_of_config_and_seed():
    a, b = run_utility(TINY, "noise", {"sigma": 0.1}), run_utility(TINY, "noise", {"sigma": 0.1})
    assert a["status"] == "ok" and a["accuracy"] == b["accuracy"] and a["extra"] == b["extra"]
    c = run_utility(dataclasses.replace(TINY, seed=1), "noise", {"sigma": 0.1})
    assert json.loads(c["extra"])["curve"] != json.loads(a["extra"])["curve"]


def test_the_baseline_and_a_defended_run_see_the_same_batches():
    """A defense that changes nothing gives the baseline's accuracy bit for bit (paired comparison)."""
    base = run_utility(TINY, "none", {})
    same = run_utility(TINY, "noise", {"sigma": 0.0})
    assert json.loads(base["extra"])["curve"] == json.loads(same["extra"])["curve"]


def test_train_utility_result_is_used_and_the_loop_skipped():
    Protocol.rounds = 0
    row = run_utility(dataclasses.replace(TINY, seed=2), "test-protocol", {})
    assert row["status"] == "ok", row["error"]
    assert Protocol.rounds == 0
    assert row["accuracy"] == pytest.approx(0.52) and row["epsilon"] == 3.0
    assert json.loads(row["extra"])["participants"] == 200


def test_a_diverging_run_is_stored_as_failed_with_its_reason():
    row = run_utility(dataclasses.replace(TINY, server_lr=1e30), "none", {})
    assert row["status"] == "failed" and "NonFiniteUpdate" in row["error"] and row["accuracy"] is None


@needs_fmnist
def test_accuracy_falls_as_noise_grows_and_as_pruning_grows_on_fashion_mnist():
    """Short FedSGD runs of the 256-unit MLP (suites/defense-costs.toml runs the full 1000 rounds at 10 clients)."""
    cfg = UtilityConfig(dataset="fashion-mnist", model="mlp", clients=2, training_rounds=60, batch_size=32, server_lr=0.1)
    train, test = load_utility_data(cfg)
    acc = lambda d, p: federated_training(cfg, gleak.create("protocol", "fedsgd"), (d, p), train, test)["accuracy"]  # noqa: E731
    base = acc("none", {})  # 74% after 60 rounds (86% after 1000: results/defense-costs)
    noise = [acc("noise", {"sigma": s}) for s in (1e-3, 0.3)]
    prune = [acc("topk", {"ratio": r}) for r in (0.99, 0.9999)]
    assert base > 0.7, base
    # Seeds 0 and 1 (measured): noise 0.744 -> 0.744 -> 0.644 and 0.753 -> 0.753 -> 0.629; pruning 0.744 -> 0.717 -> 0.508
    # and 0.753 -> 0.702 -> 0.563. (Far larger noise does not fall much further on this ReLU MLP: its weights grow
    # with the noise and the gradient signal grows with them.)
    assert abs(noise[0] - base) < 0.01 and noise[1] < noise[0] - 0.05, (base, noise)
    assert prune[0] < base - 0.01 and prune[1] < prune[0] - 0.1, (base, prune)


def test_published_defense_costs_meet_the_issue():
    """results/defense-costs (from `python -m gleak run suites/defense-costs.toml`): the undefended MLP reaches 85% on
    Fashion-MNIST; accuracy falls as noise and pruning grow; each DP row's epsilon is opacus' for its horizon."""
    path = ROOT / "results" / "defense-costs" / "utility.csv"
    if not path.is_file():
        pytest.skip("results/defense-costs not published in this checkout")
    rows = list(csv.DictReader(path.open()))
    assert set(UTILITY_CONTRACT) <= set(rows[0]) and all(r["status"] == "ok" for r in rows)
    base = float(rows[0]["baseline_accuracy"])
    assert base >= 0.85
    none = [r for r in rows if r["defense"] == "none"]
    assert float(none[0]["accuracy"]) == base and none[0]["epsilon"] == ""
    for dist in ("gaussian", "laplace"):
        pts = sorted((json.loads(r["defense_params"])["sigma"], float(r["accuracy"])) for r in rows
                     if r["defense"] == "noise" and json.loads(r["defense_params"]).get("distribution") == dist
                     and json.loads(r["defense_params"])["mode"] == "absolute")  # fmt: skip
        assert len(pts) == 5 and pts[4][1] < pts[3][1] < pts[0][1] - 0.01 and pts[2][1] > pts[3][1], pts
    pts = sorted((json.loads(r["defense_params"])["ratio"], float(r["accuracy"])) for r in rows if r["defense"] == "topk")
    assert len(pts) == 6 and pts[-1][1] < pts[-2][1] < pts[0][1], pts
    from opacus.accountants import RDPAccountant

    dp = [r for r in rows if r["defense"] == "noise" and json.loads(r["defense_params"])["mode"] == "dp"]
    assert len(dp) == 3
    for r in dp:
        p, extra = json.loads(r["defense_params"]), json.loads(r["extra"])
        z = gleak.create("defense", "noise", **p).z
        acc = RDPAccountant()
        for _ in range(extra["steps"]):
            acc.step(noise_multiplier=z, sample_rate=extra["sample_rate"])
        assert float(r["epsilon"]) == pytest.approx(acc.get_epsilon(delta=extra["delta"]), rel=1e-9)
        if p["target_epsilon"] is not None:
            assert p["target_epsilon"] - 0.011 <= float(r["epsilon"]) <= p["target_epsilon"]
    by_z = sorted((gleak.create("defense", "noise", **json.loads(r["defense_params"])).z, float(r["accuracy"])) for r in dp)
    assert by_z[-1][1] < by_z[0][1] - 0.1 and all(a < base - 0.05 for _, a in by_z), by_z  # clipping costs, noise more


def test_utility_csv_contract_cache_and_resume(utility_run, tmp_path, capsys):
    import shutil

    suite, first, stderr, env = utility_run
    assert "utility: 6 training runs made, 0 failed" in stderr
    rows = list(csv.DictReader((first / "utility.csv").open()))
    assert list(rows[0])[: len(UTILITY_CONTRACT)] == UTILITY_CONTRACT and len(rows) == 6
    assert len({r["baseline_accuracy"] for r in rows}) == 1 and rows[0]["accuracy"] == rows[0]["baseline_accuracy"]
    assert [r["epsilon"] == "" for r in rows] == [True] * 5 + [False]
    assert all(0 <= float(r["accuracy"]) <= 1 for r in rows)
    md = (first / "leaderboard.md").read_text()
    assert re.search(r"\| accuracy +\| epsilon +\|", md) and "## Utility" in md  # columns padded (tabulate)
    out = tmp_path / "out"
    shutil.copytree(first, out)
    db = out / "results.sqlite"
    con = sqlite3.connect(db)
    before = dict(con.execute("SELECT utility_id, finished_at FROM utility").fetchall())
    victim = sorted(before)[0]
    con.execute("DELETE FROM utility WHERE utility_id = ?", (victim,))  # as if the run had been interrupted there
    con.commit()
    con.close()
    from gleak.orchestration.runner import run_suite

    summary = run_suite(load_suite(suite), out, progress=False)  # in-process: the CLI path ran in the fixture
    assert summary.exit_code == 0 and summary.ran == 0
    assert "utility: 1 training runs made, 0 failed" in capsys.readouterr().err
    after = dict(sqlite3.connect(db).execute("SELECT utility_id, finished_at FROM utility").fetchall())
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before if k != victim)
    strip = lambda rs: [{k: v for k, v in x.items() if k != "seconds"} for x in rs]  # noqa: E731
    assert strip(csv.DictReader((out / "utility.csv").open())) == strip(rows)  # the recomputed run is the same


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda s: s.replace("rounds = 4", "roundz = 4"), "[utility] key 'roundz': unknown key; did you mean 'rounds'"),
        (lambda s: s.replace("rounds = 4", 'rounds = "many"'), "[utility] key 'training_rounds': must be int"),
        (lambda s: s.replace("rounds = 4", "rounds = 0"), "[utility] key 'training_rounds': must be >= 1"),
        (lambda s: s.replace("rounds = 4", "rounds = 4\ntraining_rounds = 4"), "[utility] key 'rounds': is the old name of training_rounds: give training_rounds only"),
        (lambda s: s.replace("clients = 2", "clients = 2\nlocal_steps = 3"), "[utility] key 'local_steps': applies to algorithm 'fedavg' only"),
        (lambda s: s.replace("batch_size = 8", "batch_size = 500"), "[utility] key 'batch_size': batch_size x local_steps = 500 exceeds"),
        (lambda s: s.replace("resolution = 16\nclients", 'resolution = 16\ndata_root = "/nonexistent"\nclients').replace(
            'dataset = "skimage"\nmodel = "mlp"\nmodel_params = { hidden = [32] }\nresolution = 16\ndata_root',
            'dataset = "fashion-mnist"\nmodel = "mlp"\nresolution = 16\ndata_root'), "[utility] key 'dataset': dataset 'fashion-mnist'"),
        (lambda s: s.replace("{ hidden = [32] }\nresolution = 16\nclients", "{ width = 3 }\nresolution = 16\nclients"),
         "[utility] key 'model_params.width': model 'mlp' has no parameter 'width'"),
        (lambda s: s.replace("noise_multiplier = 1.0", "sigma = 1.0"), "[defense #4]: defense 'noise': sigma applies to mode 'absolute' only"),
    ],
)  # fmt: skip
def test_bad_utility_table_is_one_clear_line(tmp_path, utility_suite, edit, needle):
    bad = tmp_path / "bad.toml"
    text = edit(utility_suite)
    assert text != utility_suite
    bad.write_text(text)
    with pytest.raises(InputError) as exc:
        load_suite(bad)
    msg = str(exc.value)
    assert str(bad) in msg and needle in msg and "\n" not in msg, msg
