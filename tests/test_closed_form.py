"""The closed-form family: exact at batch size 1, iDLG right on every trial, what batching does."""
import torch

import gleak
from gleak.config import CaseConfig, TrialConfig
from gleak.threat import Knowledge, Observation, Update
from gleak.trial import execute

LINEAR = CaseConfig(dataset="uniform", resolution=8, channels=1, model="linear",
                    model_params={"init": "normal", "init_std": 0.5}, dtype="float64")  # fmt: skip


def _linear_update(x, y, W, b):
    z = x @ W.T + b
    dz = (torch.softmax(z, -1) - torch.nn.functional.one_hot(y, W.shape[0]).to(x)) / len(x)
    return dz.T @ x, dz.sum(0), dz


def _observe(dw, db, batch):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(dw.shape[1], dw.shape[0])).double()
    k = Knowledge(input_shape=(1, 8, 8), num_classes=dw.shape[0], batch_size=batch)
    return Observation(Update({"1.weight": dw, "1.bias": db}), k, model)


def test_exact_at_batch_size_one_float64():
    for seed in range(5):
        s = execute(TrialConfig("t", "closed-form", {}, "none", {}, LINEAR, seed))
        assert s["mse"] < 1e-20, s["mse"]
        assert s["verdict"] == "recovered"


def test_exact_on_real_images_with_mlp():
    case = CaseConfig(dataset="skimage", model="mlp")
    s = execute(TrialConfig("t", "closed-form", {}, "none", {}, case, 0))
    assert s["mse"] < 1e-10 and s["psnr"] > 100


def test_batch_row_is_exact_for_the_mixture_never_a_sample():
    g = torch.Generator().manual_seed(3)
    W, b = torch.randn(10, 64, generator=g, dtype=torch.float64) * 0.5, torch.randn(10, generator=g, dtype=torch.float64) * 0.5
    x = torch.rand(4, 64, generator=g, dtype=torch.float64)
    y = torch.tensor([1, 5, 5, 7])
    dw, db, dz = _linear_update(x, y, W, b)
    rec = gleak.create("attack", "closed-form", rows="largest").reconstruct(_observe(dw, db, 4), g)
    i = int(torch.argmax(db.abs()))
    mixture = (dz[:, i] @ x) / dz[:, i].sum()
    assert torch.allclose(rec.x.flatten(), mixture, atol=1e-12)
    assert min(float(((rec.x.flatten() - xi) ** 2).mean()) for xi in x) > 1e-4


def test_agreement_rows_recover_a_whole_batch_from_an_mlp():
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=4)
    s = execute(TrialConfig("t", "closed-form", {"rows": "agreement"}, "none", {}, case, 0))
    assert s["matched"] == 4 and s["mse"] < 1e-8


def test_idlg_label_right_on_every_trial():
    hits = 0
    for seed in range(300):
        s = execute(TrialConfig("t", "idlg", {}, "none", {}, LINEAR, seed))
        hits += s["label_acc"] == 1.0
    assert hits == 300


def test_idlg_on_lenet_and_mlp_real_images():
    for model in ("lenet", "mlp"):
        for seed in range(10):
            s = execute(TrialConfig("t", "idlg", {}, "none", {}, CaseConfig(model=model, resolution=16), seed))
            assert s["label_acc"] == 1.0, (model, seed)


def test_batch_label_strategies_on_distinct_labels():
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=4, distinct_labels=True)
    for strategy in ("bias-sign", "count-aware"):
        accs = [execute(TrialConfig("t", "idlg", {"labels": strategy}, "none", {}, case, s))["label_acc"] for s in range(5)]
        assert sum(accs) / len(accs) >= 0.75, (strategy, accs)


def test_closed_form_refuses_a_conv_model_cleanly():
    from gleak.trial import run_trial

    row = run_trial(TrialConfig("t", "closed-form", {}, "none", {}, CaseConfig(model="lenet"), 0))
    assert row["status"] == "not-applicable" and row["error"].startswith("UnsupportedCase")  # not applicable, not a failure


def test_everything_pruned_falls_back_to_the_mean_image():
    s = execute(TrialConfig("t", "closed-form", {}, "topk", {"ratio": 1.0}, LINEAR, 0))
    assert s["verdict"] == "defended" and '"usable_rows": 0' in __import__("json").dumps(s["extra"])
