"""cgd-attacks: the t = m - 2 cells of different m must not reuse one pair of honest samples (the victims of each m are
independent), and the benchmark counts the trials whose honest samples share a label."""
import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _suite(monkeypatch):
    import gleak.orchestration.suite as S

    monkeypatch.setattr(S, "_check_data", lambda *a, **k: None)
    monkeypatch.setattr(S, "_utility", lambda *a, **k: None)
    return S.load_suite(ROOT / "suites" / "cgd-attacks.toml")


def test_each_m_has_its_own_victims(monkeypatch):
    """The honest samples are the first of a seed's data stream, so independent victims across m need disjoint seeds."""
    seeds: dict = {}
    for t in _suite(monkeypatch).trials:
        if not t.defense_params.get("split_features"):
            seeds.setdefault((t.case.model, t.case.clients), set()).add(t.seed)
    for model in {k[0] for k in seeds}:
        per_m = [s for (mod, _), s in seeds.items() if mod == model]
        assert len(per_m) == 4 and sum(len(s) for s in per_m) == len(set().union(*per_m)), (model, seeds)


def test_the_benchmark_reads_the_honest_labels_of_the_trials_draw(monkeypatch):
    spec = importlib.util.spec_from_file_location("cgd_attacks", ROOT / "benchmarks" / "cgd_attacks.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from gleak.orchestration.trial import DTYPES, draw_batches, load_case_data

    trial = next(t for t in _suite(monkeypatch).trials if t.case.model == "linear" and t.case.clients == 4)
    batches = draw_batches(load_case_data(trial), trial, DTYPES[trial.case.dtype])
    want = [int(b.y[0]) for b in batches[:2]]
    assert bench.honest_labels(trial.case.to_dict(), trial.seed, 2) == want
    assert torch.equal(torch.tensor(bench.honest_labels(trial.case.to_dict(), trial.seed, 4)), torch.cat([b.y for b in batches]))
