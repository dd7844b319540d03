"""The closed-form family: exact at batch size 1, iDLG right on every trial, what batching does."""
import torch

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.wire import Knowledge, Observation, Update
from gleak.orchestration.trial import execute

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
    from gleak.orchestration.trial import run_trial

    row = run_trial(TrialConfig("t", "closed-form", {}, "none", {}, CaseConfig(model="lenet"), 0))
    assert row["status"] == "not-applicable" and row["error"].startswith("UnsupportedCase")  # not applicable, not a failure


def test_everything_pruned_falls_back_to_the_mean_image():
    s = execute(TrialConfig("t", "closed-form", {}, "topk", {"ratio": 1.0}, LINEAR, 0))
    assert s["verdict"] == "defended" and '"usable_rows": 0' in __import__("json").dumps(s["extra"])


QUANTIZERS = [("quantization", {"format": "fp16"}), ("quantization", {"format": "bf16"}),
              ("quantization", {"format": "int", "bits": 8}), ("noise", {"sigma": 1e-3})]  # fmt: skip


def test_quantization_and_small_noise_are_not_defenses_at_batch_4():
    """Issue 11: on the embedded images at B = 4, fp16, bf16, int8 and Gaussian noise 1e-3 do not stop the closed
    form: it recovers (margin verdict) in at least 3 of 4 seeds each (6 of 6 when measured), and the tolerance it
    picked differs by defense (it adapts; a fixed one gave 13-15 dB here)."""
    case = CaseConfig(dataset="skimage", model="mlp", batch_size=4)
    tols = {}
    for name, params in QUANTIZERS:
        verdicts = []
        for seed in range(4):
            s = execute(TrialConfig("t", "closed-form", {}, name, params, case, seed))
            verdicts.append(s["verdict"])
            tols.setdefault(name + str(params), set()).add(s["extra"]["tol"])
        assert verdicts.count("recovered") >= 3, (name, params, verdicts)
    assert len(set().union(*tols.values())) > 2


def test_the_batch_size_is_the_count_behind_the_aggregate():
    """Two clients' summed update (8 samples) is inverted as 8, even though the victim's own batch holds 4; without
    'batch_size' in the threat model the attack would assume one."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).double()
    x, y = torch.rand(8, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    update = Update(dict(zip([n for n, _ in model.named_parameters()], grads)), "gradient", 8)
    k = Knowledge(input_shape=(1, 8, 8), num_classes=10, batch_size=4)
    rec = gleak.create("attack", "closed-form").reconstruct(Observation(update, k, model), g)
    assert rec.x.shape[0] == 8 and rec.extra["rows_used"] == 8
