"""DLG and Inverting Gradients: recovery on the setting DLG was built for, and the optimiser properties of IG."""
import copy

import pytest
import torch
import torch.nn.functional as F
from gleak.attacks._gradmatch import observed_gradient
from gleak.attacks.inverting_gradients import milestones, total_variation

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig
from gleak.contracts.seeds import derive_seed
from gleak.contracts.wire import ClientBatch, Knowledge, Observation
from gleak.mechanics.client_update import fedavg_update, fedsgd_update
from gleak.mechanics.data import load_dataset
from gleak.mechanics.models import create_model
from gleak.orchestration.trial import execute

LENET16 = CaseConfig(dataset="skimage", model="lenet", resolution=16)


def _lenet_observation(seed=0, batch_size=1, labels=False):
    """A victim batch of real 16x16 images, its FedSGD gradient on DLG's untrained LeNet, and what IG may know."""
    ds = load_dataset("skimage", resolution=16)
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:batch_size]
    batch = ClientBatch(ds.normalized(idx), ds.y[idx], ds.mean, ds.std)
    model = create_model("lenet", ds.input_shape, ds.num_classes, seed=derive_seed(seed, "model"))
    k = Knowledge(ds.input_shape, ds.num_classes, batch_size=batch_size, mean=ds.mean, std=ds.std,
                  labels=batch.y.clone() if labels else None)  # fmt: skip
    return Observation(fedsgd_update(model, batch), k, copy.deepcopy(model)), batch, model


# ---- DLG -----------------------------------------------------------------------------------------------------------
def test_dlg_recovers_an_untrained_lenet_image_and_idlg_labels_do_no_worse():
    # 12 L-BFGS iterations (measured: 45.5 dB soft, 48.1 dB iDLG, about 22 s each; 20 took 37 s each and tested nothing more)
    soft = execute(TrialConfig("t", "dlg", {"iterations": 12}, "none", {}, LENET16, 0))
    idlg = execute(TrialConfig("t", "dlg", {"iterations": 12, "labels": "idlg"}, "none", {}, LENET16, 0))
    assert soft["psnr"] > 25, soft
    assert soft["label_acc"] == 1.0 and idlg["label_acc"] == 1.0
    # At least as good: equal up to float32 noise once both sit at the precision floor (~75 dB).
    assert idlg["psnr"] > 25 and idlg["psnr"] >= min(soft["psnr"], 60.0) - 0.5, (soft["psnr"], idlg["psnr"])


def test_dlg_with_too_few_steps_does_not_recover():
    """The 25 dB bar above is not met by an unconverged dummy: the test can fail."""
    s = execute(TrialConfig("t", "dlg", {"iterations": 1, "max_iter": 3}, "none", {}, LENET16, 0))
    assert s["psnr"] < 20


def test_dlg_stops_at_a_non_finite_step_and_keeps_the_last_finite_images():
    obs, batch, _ = _lenet_observation()
    huge = obs.update.map(lambda _, t: t * 1e30)  # a distance that overflows float32 on the first step
    rec = gleak.create("attack", "dlg", iterations=5).reconstruct(
        Observation(huge, obs.knowledge, obs.model), torch.Generator().manual_seed(0)
    )
    assert torch.isfinite(rec.x).all() and rec.extra["stopped_at"] >= 0


# ---- Inverting Gradients -------------------------------------------------------------------------------------------
def test_total_variation_is_the_mean_absolute_neighbour_difference():
    assert float(total_variation(torch.full((1, 3, 8, 8), 0.7))) == 0.0
    x = torch.zeros(1, 1, 4, 4)
    x[..., :, 2:] = 1.0  # one vertical edge: 1 of 3 horizontal differences per row, no vertical ones
    assert float(total_variation(x)) == pytest.approx(1 / 3)
    y = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert float(total_variation(y + 5.0)) == pytest.approx(float(total_variation(y)), rel=1e-5)


def test_step_schedule_decays_tenfold_at_three_five_and_seven_eighths(monkeypatch):
    assert milestones(8) == (3, 5, 7) and milestones(4800) == (1800, 3000, 4200)
    seen = []
    real_step = torch.optim.Adam.step

    def spy(self, *a, **kw):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    obs, _, _ = _lenet_observation()
    gleak.create("attack", "inverting-gradients", iterations=8).reconstruct(obs, torch.Generator().manual_seed(0))
    assert seen == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01, 1e-3, 1e-3, 1e-4])
    seen.clear()
    gleak.create("attack", "inverting-gradients", iterations=8, lr_decay=False).reconstruct(obs, torch.Generator().manual_seed(0))
    assert seen == pytest.approx([0.1] * 8)


def test_box_keeps_every_pixel_in_the_valid_range():
    obs, _, _ = _lenet_observation()
    k = obs.knowledge
    lo, hi = (-k.mean / k.std).view(-1, 1, 1), ((1 - k.mean) / k.std).view(-1, 1, 1)
    x_box, _, _, _ = gleak.create("attack", "inverting-gradients", iterations=20).reconstruct_all(obs, torch.Generator().manual_seed(0))
    assert ((x_box >= lo - 1e-6) & (x_box <= hi + 1e-6)).all()
    x_free, _, _, _ = gleak.create("attack", "inverting-gradients", iterations=20, boxed=False).reconstruct_all(
        obs, torch.Generator().manual_seed(0)
    )
    assert ((x_free < lo) | (x_free > hi)).any()  # without the box the N(0, 1) init leaves the range


def test_restarts_differ_and_the_lowest_final_loss_wins():
    obs, _, _ = _lenet_observation()
    atk = gleak.create("attack", "inverting-gradients", iterations=30, restarts=3)
    x_all, losses, y, _ = atk.reconstruct_all(obs, torch.Generator().manual_seed(0))
    assert x_all.shape[0] == 3 and len(set(losses.tolist())) == 3
    rec = atk.reconstruct(obs, torch.Generator().manual_seed(0))
    best = int(torch.argmin(losses))
    assert rec.extra["restart"] == best and torch.equal(rec.x, x_all[best])
    # The score is the cosine distance of the returned images' gradient, recomputed here by hand.
    model = obs.model
    g = torch.autograd.grad(F.cross_entropy(model(rec.x), y), list(model.parameters()))
    flat, target = torch.cat([t.flatten() for t in g]), obs.update.flat()
    assert rec.extra["grad_loss"] == pytest.approx(float(1 - flat @ target / (flat.norm() * target.norm())), abs=1e-5)


def test_vmapped_restarts_compute_the_same_gradient_as_the_loop():
    obs, _, _ = _lenet_observation(batch_size=2)
    outs = {}
    for mode in ("vmap", "loop"):
        atk = gleak.create("attack", "inverting-gradients", restarts=3, tv=0.1, batch_restarts=mode)
        from gleak.attacks._gradmatch import attack_model

        model, names, params = attack_model(obs)
        target = list(obs.update)
        fn = atk._gradient_function(model, names, params, torch.tensor([0, 1]), target, obs.update.flat().norm())
        x = torch.randn(3, 2, *obs.knowledge.input_shape, generator=torch.Generator().manual_seed(1))
        outs[mode] = fn(x)
    assert torch.allclose(outs["vmap"][0], outs["loop"][0], atol=1e-6, rtol=1e-4)
    assert torch.allclose(outs["vmap"][1], outs["loop"][1], atol=1e-6)


def test_inverting_gradients_is_deterministic_under_a_seed():
    obs, _, _ = _lenet_observation()
    atk = gleak.create("attack", "inverting-gradients", iterations=10, restarts=2)
    a = atk.reconstruct(obs, torch.Generator().manual_seed(5)).x
    b = atk.reconstruct(obs, torch.Generator().manual_seed(5)).x
    c = atk.reconstruct(obs, torch.Generator().manual_seed(6)).x
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_inverting_gradients_improves_on_its_init():
    s0 = execute(TrialConfig("t", "inverting-gradients", {"iterations": 1}, "none", {}, LENET16, 1))
    s = execute(TrialConfig("t", "inverting-gradients", {"iterations": 300, "preset": "code"}, "none", {}, LENET16, 1))
    assert s["psnr"] > s0["psnr"] + 3 and s["extra"]["grad_loss"] < 0.1


def test_presets_and_given_labels():
    ig = gleak.create("attack", "inverting-gradients")
    assert (ig.n_iterations, ig.tv_weight) == (24_000, 1e-4)
    code = gleak.create("attack", "inverting-gradients", preset="code")
    assert (code.n_iterations, code.tv_weight) == (4_800, 0.1)
    assert gleak.create("attack", "inverting-gradients", preset="code", iterations=7).n_iterations == 7
    assert "labels" not in ig.needs and "labels" in gleak.create("attack", "inverting-gradients", labels="given").needs
    assert "labels" in gleak.create("attack", "dlg", labels="given").needs


def test_a_one_step_fedavg_delta_reads_as_the_gradient():
    obs, batch, model = _lenet_observation()
    delta = fedavg_update(model, batch, lr=0.05, local_steps=1)
    as_grad, info = observed_gradient(delta, obs.update.names(), torch.float32)
    assert info["delta_steps"] == 1
    assert torch.allclose(as_grad.flat(), obs.update.flat(), rtol=1e-3, atol=1e-6)


# ---- models and the trained state ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,count", [("resnet20", {"width": 1}, 272_474), ("resnet18", {}, 11_173_962),
                                               ("convnet", {}, 94_538)])  # fmt: skip
def test_models_have_the_published_sizes(name, params, count):
    m = create_model(name, (3, 32, 32), 10, **params)
    assert sum(p.numel() for p in m.parameters()) == count
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_trained_state_is_trained_once_cached_and_deterministic(tmp_path, monkeypatch):
    from gleak.mechanics import pretrain

    monkeypatch.setenv(pretrain.CACHE_ENV, str(tmp_path / "a"))
    monkeypatch.setattr(pretrain, "_MEMORY", {})
    case = CaseConfig(dataset="skimage", model="lenet", resolution=16, model_state="trained", train_steps=30, train_lr=0.05)
    ds = load_dataset("skimage", resolution=16)
    calls = []
    real_train = pretrain.train
    monkeypatch.setattr(pretrain, "train", lambda *a: calls.append(1) or real_train(*a))
    m1, info = pretrain.build_model(case, ds, seed=0, dtype=torch.float32)
    m2, _ = pretrain.build_model(case, ds, seed=7, dtype=torch.float32)  # another trial seed: the same trained model
    assert len(calls) == 1 and info["model_train_acc"] > 0.3
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    files = list((tmp_path / "a" / "models").glob("*.pt"))
    assert len(files) == 1
    monkeypatch.setattr(pretrain, "_MEMORY", {})  # a new process: read from disk, no training
    m3, _ = pretrain.build_model(case, ds, seed=0, dtype=torch.float32)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m3.state_dict().values()))
    monkeypatch.setenv(pretrain.CACHE_ENV, str(tmp_path / "b"))  # an empty cache: trains again, to the same weights
    monkeypatch.setattr(pretrain, "_MEMORY", {})
    m4, _ = pretrain.build_model(case, ds, seed=0, dtype=torch.float32)
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m4.state_dict().values()))
    fresh, none = pretrain.build_model(CaseConfig(dataset="skimage", model="lenet", resolution=16), ds, 0, torch.float32)
    assert none == {} and not torch.equal(fresh.fc.weight, m1.fc.weight)


def test_model_mode_sets_batchnorm_statistics():
    from gleak.mechanics.pretrain import build_model

    ds = load_dataset("skimage", resolution=16)
    m, _ = build_model(CaseConfig(model="resnet20", model_params={"width": 1}, model_mode="eval"), ds, 0, torch.float32)
    assert not m.training and not m.layers[0].bn1.training
    m, _ = build_model(CaseConfig(model="resnet20", model_params={"width": 1}), ds, 0, torch.float32)
    assert m.training


def test_leaderboard_keeps_trained_and_untrained_apart():
    import json

    import pandas as pd

    from gleak.reporting.aggregate import aggregate

    def row(state, psnr):
        case = json.dumps({"dataset": "skimage", "model": "lenet", "batch_size": 1, "model_state": state})
        return dict(dataset="skimage", model="lenet", batch_size=1, defense="none", defense_params="{}", attack="dlg",
                    attack_params="{}", status="ok", mse=0.01, psnr=psnr, ssim=0.5, lpips=None, cosine=0.9,
                    label_acc=1.0, grad_dist=0.0, extra="{}", seconds=1.0, case=case)  # fmt: skip

    agg = aggregate(pd.DataFrame([row("untrained", 40.0), row("untrained", 44.0), row("trained", 10.0)]))
    assert sorted(agg["variant"]) == ["", "model_state=trained"]  # the default state names no variant
    assert sorted(agg["psnr"]) == [10.0, 42.0]


@pytest.mark.parametrize("attack,params", [("dlg", {"iterations": 2, "max_iter": 5}),
                                           ("inverting-gradients", {"iterations": 5, "labels": "bias-sign"})])  # fmt: skip
def test_batches_are_reconstructed_whole_and_matched(attack, params):
    case = CaseConfig(dataset="skimage", model="lenet", resolution=16, batch_size=4)
    s = execute(TrialConfig("t", attack, params, "none", {}, case, 0))
    assert s["matched"] == 4 and s["label_acc"] is not None
