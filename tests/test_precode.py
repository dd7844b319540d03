"""PRECODE: the variational bottleneck before the classifier, sampled from the client's generator, trained with
its KL term, held by the observer, and trained by the utility loop."""
import math

import pytest
import torch
from gleak.defenses.precode import Precode, VariationalBottleneck, bottlenecks

import gleak
from gleak.contracts.config import CaseConfig, TrialConfig, UtilityConfig
from gleak.contracts.plugin import Attack
from gleak.contracts.wire import Reconstruction
from gleak.mechanics.data import ImageDataset
from gleak.mechanics.models import create_model
from gleak.orchestration.trial import execute
from gleak.orchestration.utility import federated_training


def _wrapped(seed=0, latent=8):
    model = create_model("mlp", (1, 6, 6), 4, seed=seed, dtype=torch.float64, hidden=[16])
    return model, Precode(latent=latent).wrap_model(model, torch.Generator().manual_seed(seed))


def _batch(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def test_the_bottleneck_sits_before_the_classifier_and_the_original_is_untouched():
    model, wrapped = _wrapped()
    names = [n for n, _ in wrapped.named_parameters()]
    assert names == ["1.weight", "1.bias", "3.0.encoder.weight", "3.0.encoder.bias", "3.0.decoder.weight",
                     "3.0.decoder.bias", "3.1.weight", "3.1.bias"]  # fmt: skip
    assert [n for n, _ in model.named_parameters()] == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert wrapped[3][0].encoder.weight.shape == (16, 16) and wrapped[3][0].decoder.weight.shape == (16, 8)
    assert torch.equal(wrapped[3][1].weight, model[3].weight) and torch.equal(wrapped[1].weight, model[1].weight)
    again = Precode(latent=8).wrap_model(model, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(wrapped.parameters(), again.parameters()))  # drawn from the generator
    assert Precode().latent == 256 and Precode().beta == 1e-3


def test_the_bottleneck_is_sampled_from_the_given_generator():
    _, wrapped = _wrapped()
    x, y = _batch()
    vb = bottlenecks(wrapped)[0]
    outs = []
    for seed in (1, 1, 2):
        vb.generator = torch.Generator().manual_seed(seed)
        outs.append(wrapped(x))
    vb.generator = None
    assert torch.equal(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])
    d = Precode(latent=8)
    g1 = d.client_gradient(wrapped, x, y, torch.Generator().manual_seed(3))
    g2 = d.client_gradient(wrapped, x, y, torch.Generator().manual_seed(3))
    g3 = d.client_gradient(wrapped, x, y, torch.Generator().manual_seed(4))
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    assert all(not torch.allclose(g1[n], g3[n]) for n in g1)  # every gradient, the bottleneck's noise reaches all
    assert vb.generator is None and vb.kl is None  # the client's generator does not leak into later passes


def test_the_kl_term_is_in_the_gradient_with_weight_beta():
    """beta changes the encoder's and earlier layers' gradients, never the decoder's or the classifier's (the KL
    term depends on the encoder's output only), and the KL is the closed form for N(mu, std^2) against N(0, I)."""
    _, wrapped = _wrapped(1)
    x, y = _batch(1)
    g0 = Precode(latent=8, beta=0.0).client_gradient(wrapped, x, y, torch.Generator().manual_seed(0))
    g1 = Precode(latent=8, beta=0.5).client_gradient(wrapped, x, y, torch.Generator().manual_seed(0))
    for n in g0:
        same = torch.allclose(g0[n], g1[n], atol=1e-14)
        assert same == (".decoder." in n or n.startswith("3.1.")), n
    vb = bottlenecks(wrapped)[0]
    vb.generator = torch.Generator().manual_seed(0)
    h = wrapped[2](wrapped[1](wrapped[0](x)))
    vb(h)
    with torch.no_grad():
        stats = vb.encoder(h)
    mu, std = stats[:, :8], torch.nn.functional.softplus(stats[:, 8:])
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mu, std), torch.distributions.Normal(0.0, 1.0))
    assert float(vb.kl.detach()) == pytest.approx(float(ref.sum(1).mean()) / math.log(2), rel=1e-10)
    vb.generator = None


def _toy(n, seed):
    proto = torch.rand(4, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    x = proto[y] + 2.0 * torch.rand(n, 1, 6, 6, generator=g)  # noisy enough to take a few hundred steps
    return ImageDataset("toy", x, y, tuple("abcd"), torch.tensor([0.5]), torch.tensor([0.3]))


def test_the_utility_loop_trains_the_wrapped_model_well_above_chance():
    cfg = UtilityConfig(dataset="toy", model="mlp", model_params={"hidden": [32]}, clients=2, training_rounds=200,
                        batch_size=16, server_lr=0.05)  # fmt: skip
    train, test = _toy(400, 1), _toy(200, 2)
    seen = {}
    real = Precode.client_gradient

    def spy(self, model, x, y, rng):
        seen["bottleneck"] = bool(bottlenecks(model))
        return real(self, model, x, y, rng)

    Precode.client_gradient = spy
    try:
        out = federated_training(cfg, gleak.create("protocol", "fedsgd"), ("precode", {"latent": 16}), train, test)
    finally:
        Precode.client_gradient = real
    assert seen["bottleneck"]
    assert out["accuracy"] > 0.8 and out["curve"][0][1] < out["accuracy"] - 0.2, out["curve"]  # chance: 0.25
    plain = federated_training(cfg, gleak.create("protocol", "fedsgd"), ("none", {}), train, test)
    assert abs(out["accuracy"] - plain["accuracy"]) < 0.1, (out["accuracy"], plain["accuracy"])


@gleak.register_attack("test-precode-observer")
class _Observer(Attack):
    """Test attack: records what it observes."""

    seen: dict = {}

    def reconstruct(self, observation, rng):
        _Observer.seen = {"names": observation.update.names(), "has_vb": bool(bottlenecks(observation.model))}
        return Reconstruction(x=torch.zeros(1, *observation.knowledge.input_shape, dtype=torch.float32))


def test_a_trial_wraps_the_model_and_the_observer_holds_the_wrapped_architecture():
    case = CaseConfig(dataset="skimage", model="mlp", resolution=16, batch_size=1, warmup_rounds=1)
    execute(TrialConfig("t", "test-precode-observer", {}, "precode", {"latent": 8}, case, 0))
    assert _Observer.seen["has_vb"] and any(".encoder." in n for n in _Observer.seen["names"])
    execute(TrialConfig("t", "test-precode-observer", {}, "none", {}, case, 0))
    assert not _Observer.seen["has_vb"]


def test_bad_parameters_and_models():
    with pytest.raises(ValueError, match="latent"):
        Precode(latent=0)
    with pytest.raises(ValueError, match="nn.Linear"):
        Precode().wrap_model(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3)), torch.Generator())
    assert isinstance(Precode(latent=4).wrap_model(torch.nn.Linear(3, 2), torch.Generator())[0], VariationalBottleneck)


def test_a_trained_case_trains_the_bottleneck_with_the_model(tmp_path, monkeypatch):
    """model_state = "trained": the wrapped model is what is pretrained (the paper trains its models with PRECODE),
    under a cache key of its own: the bottleneck moves from its initialisation, the model classifies its training
    data well above chance, and the trial's id says so (another computation than the untrained insertion)."""
    from gleak.api import trial_config
    from gleak.mechanics import pretrain
    from gleak.mechanics.data import load_dataset

    monkeypatch.setenv("GLEAK_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrain, "_MEMORY", {})
    case = CaseConfig(dataset="skimage", model="mlp", resolution=8, model_state="trained", train_steps=150)
    ds = load_dataset("skimage", resolution=8)
    d = Precode(latent=16)
    model, info = pretrain.build_model(case, ds, 0, torch.float32, d, ("precode", {"latent": 16, "beta": 1e-3}))
    init = d.wrap_model(pretrain.create_model("mlp", ds.input_shape, ds.num_classes, seed=0, dtype=torch.float32),
                        pretrain.generator(case.train_seed, "pretrain-defense-model"))  # fmt: skip
    (vb,), (vb0,) = bottlenecks(model), bottlenecks(init)
    for (name, p), p0 in zip(vb.named_parameters(), vb0.parameters()):
        # measured: 0.05 to 0.22 trained; weight decay alone (no gradient reaching it) moves it by 4e-4
        assert (p - p0).abs().max() > 0.02, (name, float((p - p0).abs().max()))
    model.eval()
    with torch.no_grad():
        acc = float((model(ds.normalized()).argmax(1) == ds.y).double().mean())
    assert acc > 1 / ds.num_classes + 0.3 and info["model_train_acc"] > 1 / ds.num_classes + 0.3, (acc, info)
    keys = {pretrain.training_key(case, ds, torch.float32), pretrain.training_key(case, ds, torch.float32, ("precode", {}))}
    assert len(keys) == 2 and len(list((tmp_path / "models").glob("*.pt"))) == 1  # its own key, and only it trained
    trained = trial_config("closed-form", "precode", dataset="skimage", model="mlp", model_state="trained")
    assert trained.identity()["pretrained"] == "with-defense"
    assert "pretrained" not in trial_config("closed-form", "none", dataset="skimage", model="mlp", model_state="trained").identity()
    assert "pretrained" not in trial_config("closed-form", "precode", dataset="skimage", model="mlp").identity()
