"""Learning to Invert (Wu, Chen, Guo, Weinberger, "Learning To Invert: Simple Adaptive Attacks for Gradient Inversion
in Federated Learning", UAI 2023; code wrh14/Learning_to_Invert).

The attacker holds public (auxiliary) data from the client's distribution. For each public sample (or batch) it
computes the update a client would send at the observed model, passes it through the defense exactly as the client
does, and trains an inversion model (an MLP on the flattened update) to map that defended update to its input:

    min_theta  E_(x, y) ~ public  || f_theta(D(grad L(w; x, y))) - x ||^2

D is the defense, called as the victim's client calls it (its `client_gradient`, then its `transform`), so the attack
adapts to any defense, a user's plugin included, by calling it and nothing else (Kerckhoffs: the attacker knows the
defense's name and public parameters, "knows_defense", never the client's random draws or state). The observed update
is then mapped through f_theta to the reconstruction.
"""
from __future__ import annotations

import time
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, Defense, check_choice
from gleak.contracts.registry import register_attack
from gleak.contracts.wire import ClientBatch, DefenseDescription, Knowledge, Observation, Reconstruction, Update
from gleak.mechanics import disk_cache
from gleak.mechanics.client_update import client_defense as bound_client_defense
from gleak.mechanics.client_update import fedavg_update, fedsgd_update, transmit
from gleak.mechanics.progress import report as report_progress

# Bump when what is trained or how it is stored changes, so that cached inversion models are not reused.
CACHE_FORMAT = 1
# The round protocols whose client update this attack can compute for its training pairs (the observed update is one
# client's FedSGD gradient or FedAvg delta).
PROTOCOLS = ("fedsgd", "fedavg")
REDUCTIONS = ("hash", "subset")
SCALINGS = ("none", "unit", "standardize")


def inversion_mlp(features: int, hidden: int, outputs: int) -> nn.Sequential:
    """The paper's inversion model (their code's MLP-{hidden}): Linear-ReLU-Linear-ReLU-Linear-Sigmoid, pixels in [0, 1]."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, outputs), nn.Sigmoid())  # fmt: skip


def matched_mse(pred: Tensor, target: Tensor) -> Tensor:
    """Mean squared error per pixel, pred and target (n, B, P); for B > 1 each prediction slot matched to a target
    image by the Hungarian algorithm on the per-pair MSE (the paper's permutation-invariant batch loss)."""
    if pred.shape[1] == 1:
        return F.mse_loss(pred, target)
    from scipy.optimize import linear_sum_assignment

    costs = torch.cdist(target, pred).pow(2) / target.shape[-1]  # (n, B, B): target i against prediction j
    total = pred.new_zeros(())
    for c in costs:
        rows, cols = linear_sum_assignment(c.detach().cpu().numpy())
        total = total + c[torch.as_tensor(rows), torch.as_tensor(cols)].mean()
    return total / len(costs)


class Reducer:
    """How the flattened update (D entries) becomes the inversion model's input (k entries). "all": unchanged (the
    paper's LeNet setting); "hash": every entry added into one of k bins drawn at random (their large-model code's
    hashing); "subset": k entries drawn at random (their small-model code's `selected_para`)."""

    def __init__(self, size: int, features: int | None, reduce: str, gen: torch.Generator, scaling: str = "none"):
        self.size, self.features, self.reduce, self.scaling = size, features, reduce, scaling
        self.index: Tensor | None = None
        self.mu: Tensor | None = None
        self.sd: Tensor | None = None
        if features is not None and features < size:
            if reduce == "hash":
                self.index = torch.randint(0, features, (size,), generator=gen)
            else:
                self.index = torch.randperm(size, generator=gen)[:features]

    @property
    def width(self) -> int:
        return self.size if self.index is None else int(self.features)  # type: ignore[arg-type]

    def __call__(self, flat: Tensor) -> Tensor:
        flat = flat.detach().float().cpu()
        if self.index is not None:
            flat = flat[self.index] if self.reduce == "subset" else torch.zeros(self.width).index_add_(0, self.index, flat)
        return self.scaled(flat)

    def scaled(self, v: Tensor) -> Tensor:
        """The `scaling` option: "unit" divides each reduced update by its L2 norm; "standardize" subtracts the
        training pairs' per-entry mean and divides by their per-entry standard deviation (`fit`)."""
        if self.scaling == "unit":
            return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        if self.scaling == "standardize" and self.mu is not None and self.sd is not None:
            return (v - self.mu) / self.sd
        return v

    def fit(self, feats: Tensor) -> Tensor:
        """Set the standardisation from the training pairs' features (n, k) and return them standardised."""
        if self.scaling != "standardize":
            return feats
        self.mu, sd = feats.mean(0), feats.std(0)
        self.sd = torch.where(sd > 0, sd, torch.ones_like(sd))  # an entry constant over the pairs: only centred
        return (feats - self.mu) / self.sd


def client_defense(described: DefenseDescription | None, knowledge: Knowledge) -> Defense | None:
    """A fresh instance of the described client defense, bound as the trial binds each client's (data normalisation,
    classes, an accountant of its own); None for no description."""
    if described is None:
        return None
    return bound_client_defense(described.defense, described.defense_params, knowledge.mean, knowledge.std,
                                knowledge.num_classes)  # fmt: skip


def sent_update(model: nn.Module, batch: ClientBatch, defense: Defense | None, update: Update, gen: torch.Generator) -> Update:
    """What a client holding `batch` would send at `model` through `defense`, computed as the victim's client computes
    it (gleak.mechanics.client_update): FedSGD's gradient, or FedAvg's delta with the observed update's local-training
    settings (public in the protocol); a fresh client each time (no error-feedback residual, the first round's state)."""
    if defense is not None:
        defense.reset()
    if update.kind == "delta":
        meta = update.meta
        if not meta.get("lr"):
            raise UnsupportedCase("a FedAvg delta without its local learning rate: its training pairs cannot be made")
        u = fedavg_update(model, batch, float(meta["lr"]), int(meta.get("local_steps", 1)), meta.get("local_batch_size"),
                          defense, gen)  # fmt: skip
    elif update.kind == "gradient":
        u = fedsgd_update(model, batch, defense, gen)
    else:
        raise UnsupportedCase(f"update kind {update.kind!r} is neither a gradient nor a FedAvg delta")
    return u if defense is None else transmit([defense], [u], gen)[0]


def training_pairs(
    model: nn.Module, names: list[str], knowledge: Knowledge, defense: Defense | None, update: Update, batch_size: int,
    samples: int | None, reducer: Reducer, gen: torch.Generator,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(features (n, k), target pixels (n, B, P) in [0, 1], the reducer) from the public data: n = samples // B
    batches drawn without replacement, each sent through `defense` as the victim's client sends its batch."""
    x_all, y_all = knowledge.public_x, knowledge.public_y
    assert x_all is not None and y_all is not None and knowledge.mean is not None and knowledge.std is not None
    total = len(x_all) if samples is None else min(samples, len(x_all))
    pairs = total // batch_size
    if pairs < 2:
        raise UnsupportedCase(f"learning-to-invert needs at least {2 * batch_size} public samples, has {total}")
    order = torch.randperm(len(x_all), generator=gen)[: pairs * batch_size].view(pairs, batch_size)
    feats, targets = [], []
    dtype = next(model.parameters()).dtype
    for i, idx in enumerate(order):
        batch = ClientBatch(x_all[idx].to(dtype), y_all[idx], knowledge.mean, knowledge.std)
        sent = sent_update(model, batch, defense, update, gen)
        feats.append(reducer(torch.cat([sent.tensors[n].reshape(-1) for n in names])))
        targets.append(batch.images().reshape(batch_size, -1).float())
        report_progress(i + 1, pairs, None)
    return reducer.fit(torch.stack(feats)), torch.stack(targets)


@register_attack("learning-to-invert")
class LearningToInvert(Attack):
    """Learning to Invert (Wu, Chen, Guo, Weinberger, UAI 2023): an MLP trained on public data to map defended updates to inputs.

    Parameters (the paper's defaults: their README's CIFAR-10 / LeNet command at batch size 1, MLP-3000)
    ----------
    hidden: the inversion MLP's width (3000; their B = 4 runs use 10000). Three linear layers, ReLU between, a
        sigmoid on the pixels.
    epochs: passes over the training pairs (200). lr: Adam's step size (1e-4). train_batch: pairs per Adam step (256).
    lr_drop: the learning rate is x0.1 from this fraction of the epochs on (0.75, their main_learn_dlg.py; their
        large-model script drops at 0.5); 1 never drops it.
    features: None (default): the whole flattened update is the MLP's input (the paper's LeNet setting); an int k
        below the update's size: the update reduced to k entries by `reduce` (their code reduces large models'
        updates: ResNet-20 to half its size). reduce: "hash" (default): each entry added into one of k bins drawn
        once at random (their large-model code's hashing); "subset": k entries drawn at random (their `selected_para`).
    scaling: how the (reduced) update is scaled before the MLP: "none" (default: the paper feeds the raw gradient);
        "unit": divided by its L2 norm (ours); "standardize": each entry centred and divided by its standard deviation
        over the training pairs (ours; stored with the model). Measured on tests/test_learning_to_invert.py's case
        (Fashion-MNIST 14x14, a trained MLP of 64 units, undefended, batch 1; 2,000 public samples, 1,024 random
        entries, MLP of 256, 60 epochs at lr 1e-3; seeds 0-4), median PSNR above the blind guess: "none" 10.95 dB,
        "unit" 11.96, "standardize" 12.4.
    public_samples: how many of the granted public samples make training pairs (None: all; their code: the whole
        CIFAR-10 training split, 50,000).
    adaptive: True (default): every training update passes through the described defense ("knows_defense");
        False: raw updates (the non-adaptive ablation: the inversion model never sees the defense; no "knows_defense").
    train_seed: the attacker's own randomness for training (pair draws, defense draws, initialisation, shuffling):
        fixed, so one inversion model serves every trial of a (model, defense) case and is cached on disk
        ($GLEAK_CACHE/learning-to-invert/, keyed by everything it depends on: the model's structure and weights, the
        described defense and protocol, the public data, the batch size, these parameters).

    Deviations (named): the defense is applied to the batch's update as the victim's client applies it (the authors'
    code defends each sample's gradient and averages B of them for a batch); each training pair is a fixed batch of B
    public samples (theirs re-draws batches every epoch from per-sample features); a stateful defense (error feedback)
    starts fresh for each pair; the last epoch's weights are kept (theirs keeps the best on a held-out test split,
    which the attacker does not have here); FedAvg deltas are reproduced with the observed local-training settings
    (their paper is FedSGD only). Labels: iDLG's rule on the observed update (attacks/idlg.py; none where the model
    has no final linear layer). extra: train_seconds (of the training that produced the model, cached or not),
    pair_seconds, public_samples, features (the MLP's input width), update_size, train_loss (last epoch), cached (1 when read from disk).

    Cost: the first layer has features x hidden weights; at the paper's width on a 50,900-entry update (an MLP of 64
    units on 28x28 Fashion-MNIST) that is 153M weights. Even 500 units, 50 epochs over 2,000 pairs of that whole
    update had not finished after 9 minutes on a loaded 2-core machine: on a CPU set `features` (and a smaller
    `hidden`, fewer `epochs`). suites/learned.toml's setting (1,024 entries, 256 units, 60 epochs, 2,000
    pairs) trains in 8-12 s on one core. Output: the sigmoid's pixels in [0, 1], normalised with the data mean/std
    ("data_stats"). Protocols: FedSGD and FedAvg (UnsupportedCase under any other, whose wire it cannot reproduce).
    """

    needs = frozenset({"architecture", "parameters", "batch_size", "data_stats", "public_data", "knows_defense"})
    conformance_params = {"hidden": 32, "epochs": 2, "public_samples": 16, "features": 256}

    def __init__(
        self,
        hidden: int = 3000,
        epochs: int = 200,
        lr: float = 1e-4,
        train_batch: int = 256,
        lr_drop: float = 0.75,
        features: int | None = None,
        reduce: Literal["hash", "subset"] = "hash",
        scaling: Literal["none", "unit", "standardize"] = "none",
        public_samples: int | None = None,
        adaptive: bool = True,
        train_seed: int = 0,
    ):
        for name, value in (("hidden", hidden), ("epochs", epochs), ("train_batch", train_batch)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 < lr_drop <= 1:
            raise ValueError(f"lr_drop must be in (0, 1], got {lr_drop}")
        if features is not None and features < 1:
            raise ValueError(f"features must be >= 1 or None, got {features}")
        if public_samples is not None and public_samples < 2:
            raise ValueError(f"public_samples must be >= 2 or None, got {public_samples}")
        check_choice("reduce", reduce, REDUCTIONS)
        check_choice("scaling", scaling, SCALINGS)
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {adaptive!r}")
        self.hidden, self.epochs, self.lr, self.train_batch, self.lr_drop = hidden, epochs, lr, train_batch, lr_drop
        self.features, self.reduce, self.scaling, self.public_samples = features, reduce, scaling, public_samples
        self.adaptive, self.train_seed = adaptive, train_seed
        if not adaptive:
            self.needs = self.needs - {"knows_defense"}

    @classmethod
    def estimated_cost(cls, params: dict, case) -> float:
        """Making the pairs (one client update each) and training the MLP (its multiply-adds over the pairs, in units
        of a small model's forward-backward, about 1e6 multiply-adds): a rough figure, for scheduling only."""
        p = {"hidden": 3000, "epochs": 200, "public_samples": 1000, "features": 20_000, **params}
        n = p["public_samples"] or 1000
        width = p["features"] or 20_000
        return float(n + p["epochs"] * n * p["hidden"] * (width + p["hidden"]) * 3 / 1e6)

    def reconstruct(self, observation: Observation, rng: torch.Generator) -> Reconstruction:
        k = observation.knowledge
        if observation.model is None:
            raise UnsupportedCase("learning-to-invert needs the model's architecture and parameters")
        if k.public_x is None or k.public_y is None or k.mean is None or k.std is None or k.batch_size is None:
            raise UnsupportedCase("learning-to-invert needs public data, the data mean/std and the batch size")
        if len(k.input_shape) != 3:
            raise UnsupportedCase("learning-to-invert reconstructs images (C, H, W)")
        described = k.defense if self.adaptive else None
        if self.adaptive:
            if described is None:
                raise UnsupportedCase("the adaptive learning-to-invert needs the defense's description (knows_defense)")
            if described.protocol not in PROTOCOLS:
                raise UnsupportedCase(f"learning-to-invert makes its training updates for {' or '.join(PROTOCOLS)}, "
                                      f"not {described.protocol!r}")  # fmt: skip
        import copy

        model = copy.deepcopy(observation.model)  # forward passes may touch BatchNorm buffers: a private copy
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n in names if n not in observation.update.tensors]
        if missing:
            raise UnsupportedCase(f"the update has no tensor for parameter(s) {', '.join(missing[:3])}")
        net, reducer, info = self.inversion_model(model, names, k, described, observation.update)
        observed = reducer(torch.cat([observation.update.tensors[n].detach().reshape(-1) for n in names]))
        with torch.no_grad():
            pixels = net(observed.unsqueeze(0)).view(k.batch_size, *k.input_shape)
        dtype = next(observation.model.parameters()).dtype
        shape = (1, -1, 1, 1)
        x = ((pixels.double() - k.mean.double().view(shape)) / k.std.double().view(shape)).to(dtype)
        return Reconstruction(x=x, y=self._labels(observation, model, k), extra=info)

    @staticmethod
    def _labels(observation: Observation, model: nn.Module, k: Knowledge) -> Tensor | None:
        from gleak.attacks.idlg import recover_labels

        try:
            return recover_labels(observation.update, model, k, int(k.batch_size or 1), "idlg")
        except UnsupportedCase:
            return None

    def cache_key(self, model: nn.Module, k: Knowledge, described: DefenseDescription | None, update: Update) -> str:
        """Everything the trained inversion model depends on."""
        state = {n: t.detach().cpu() for n, t in model.state_dict().items()}
        public = {"x": k.public_x.cpu(), "y": k.public_y.cpu()}  # type: ignore[union-attr]
        return disk_cache.key_of({
            "format": CACHE_FORMAT, "attack": self.get_params(), "torch": torch.__version__,
            "model": f"{type(model).__module__}.{type(model).__qualname__}\n{model}", "training": model.training,
            "weights": disk_cache.tensors_digest(state), "public": disk_cache.tensors_digest(public),
            "stats": [k.mean.tolist(), k.std.tolist()], "batch_size": k.batch_size,  # type: ignore[union-attr]
            "defense": None if described is None else [described.defense, described.defense_params, described.protocol,
                                                       described.protocol_params],  # fmt: skip
            "update": [update.kind, {m: update.meta.get(m) for m in ("lr", "local_steps", "local_batch_size")}],
        })  # fmt: skip

    def inversion_model(
        self, model: nn.Module, names: list[str], k: Knowledge, described: DefenseDescription | None, update: Update
    ) -> tuple[nn.Module, Reducer, dict[str, Any]]:
        """The trained inversion MLP and its input reduction: from the disk cache, or trained now (under a file lock,
        so that parallel workers wait for the one that trains)."""
        from filelock import FileLock

        key = self.cache_key(model, k, described, update)
        folder = disk_cache.cache_dir() / "learning-to-invert"
        path = folder / f"{key}.pt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock: Any = FileLock(folder / f"{key}.lock", thread_local=False)
        except OSError:  # a cache folder that cannot be written: train without it
            import contextlib

            lock = contextlib.nullcontext()
        with lock:
            saved = disk_cache.read_tensors(path, key)
            if saved is not None:
                return self._restore(saved)
            net, reducer, info, tensors = self.train(model, names, k, described, update)
            disk_cache.write_tensors(path, key, tensors)
        return net, reducer, info

    def _restore(self, saved: dict[str, Tensor]) -> tuple[nn.Module, Reducer, dict[str, Any]]:
        shape = saved["shape"].tolist()  # [update size, input width, outputs, has index]
        reducer = Reducer(int(shape[0]), None, self.reduce, torch.Generator(), self.scaling)
        if shape[3]:
            reducer.index, reducer.features = saved["index"], int(shape[1])
        reducer.mu, reducer.sd = saved.get("mu"), saved.get("sd")
        net = inversion_mlp(int(shape[1]), self.hidden, int(shape[2]))
        net.load_state_dict({n[4:]: t for n, t in saved.items() if n.startswith("net.")})
        net.eval()
        info = {name: float(saved[name]) for name in ("train_seconds", "pair_seconds", "train_loss")}
        info.update(public_samples=int(saved["public_samples"]), features=reducer.width, update_size=reducer.size, cached=1)
        return net, reducer, info

    def train(
        self, model: nn.Module, names: list[str], k: Knowledge, described: DefenseDescription | None, update: Update
    ) -> tuple[nn.Module, Reducer, dict[str, Any], dict[str, Tensor]]:
        """Make the training pairs through the defense, train the MLP; (net, reducer, extra, tensors to cache)."""
        gen = torch.Generator().manual_seed(int(self.train_seed))
        batch_size = int(k.batch_size)  # type: ignore[arg-type]
        start = time.perf_counter()
        size = sum(int(p.numel()) for n, p in model.named_parameters() if n in names)
        reducer = Reducer(size, self.features, self.reduce, gen, self.scaling)
        feats, targets = training_pairs(model, names, k, client_defense(described, k), update, batch_size,
                                        self.public_samples, reducer, gen)  # fmt: skip
        pair_seconds = time.perf_counter() - start
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # nn.Linear's init draws from the global generator: seeded, then restored
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            net = inversion_mlp(reducer.width, self.hidden, targets.shape[1] * targets.shape[2])
        opt = torch.optim.Adam(net.parameters(), lr=self.lr)
        drop = int(self.lr_drop * self.epochs) if self.lr_drop < 1 else None
        n, loss_sum = len(feats), 0.0
        for epoch in range(self.epochs):
            if epoch == drop:
                for group in opt.param_groups:
                    group["lr"] = self.lr * 0.1
            order, loss_sum = torch.randperm(n, generator=gen), 0.0
            for lo in range(0, n, self.train_batch):
                idx = order[lo : lo + self.train_batch]
                pred = net(feats[idx]).view(len(idx), *targets.shape[1:])
                loss = matched_mse(pred, targets[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss_sum += float(loss.detach()) * len(idx)
            report_progress(epoch + 1, self.epochs, loss_sum / n)
        net.eval()
        train_seconds = time.perf_counter() - start
        info = {"train_seconds": train_seconds, "pair_seconds": pair_seconds, "train_loss": loss_sum / n,
                "public_samples": n * batch_size, "features": reducer.width, "update_size": reducer.size, "cached": 0}  # fmt: skip
        tensors = {f"net.{name}": t.detach().clone() for name, t in net.state_dict().items()}
        tensors.update(shape=torch.tensor([reducer.size, reducer.width, targets.shape[1] * targets.shape[2], reducer.index is not None]),
                       train_seconds=torch.tensor(train_seconds), pair_seconds=torch.tensor(pair_seconds),
                       train_loss=torch.tensor(info["train_loss"]), public_samples=torch.tensor(n * batch_size))  # fmt: skip
        for name in ("index", "mu", "sd"):
            if getattr(reducer, name) is not None:
                tensors[name] = getattr(reducer, name)
        return net, reducer, info, tensors
