"""Confined Gradient Descent (Zhang, Bai, Li, Nepal and Ko: "Confined Gradient Descent: Privacy-preserving Optimization for Federated
Learning"), a Protocol: in attack trials its rounds run through gleak.mechanics.rounds.run_rounds, in utility runs it trains
with the vectorised engine (protocols/cgd_training.py), the fast path of the same rounds.

Attack trials (gleak.orchestration.trial): the case's clients are the m participants (the victim is client 0), each holding its
batch as its whole local data set (horizontal, Algorithm 1). Each participant computes its gradient at its own
confined model w^l_1 = delta^l Rand^l (equation 11; Rand^l is N(0, 1) truncated to [-1, 1] by default, `init_law`);
the gradients are summed by additive secret sharing over Z_2^32
(gleak.mechanics.secret_sharing, the share protocol itself); every participant steps its own model with alpha_k times the sum
(`server_step`: CGD's own public schedule, not the case's server step). Warm-up rounds (case warmup_rounds > 0) are CGD
rounds too, on fresh batches, from the same confined models. An active attack is refused (UnsupportedCase): the
participants never compute at a model the server built, so a prepared model would be silently discarded.
The adversary is the paper's: up to t <= m - 2 colluding participants (the last t clients) plus the aggregator.
It sees the reconstructed sum of every iteration, knows the public step sizes and its own confined models and data,
and so holds the honest participants' summed gradient Sum_{l honest} g^l(w^l_k, xi_l) (it subtracts its own
encodings from the ring sum); it never sees an honest participant's confined model. The observed update is that
honest sum; over `iterations` observed iterations the earlier ones reach the attack as Observation.rounds.
The model the observer holds is its best proxy of the honest models: a colluder's confined model ("colluder",
the default: a draw from the same law, moved by the same public steps; a draw of the attacker's own when t = 0) or
the mean of the init law moved by the public steps ("mean": zero plus the public offset, every w^l_k - w^l_1 being
the public sum of past steps). `confined = false` is the comparison the paper makes, federated SGD with secure
aggregation over the same clients: one shared model (same init law), known to the observer, same secure sum.

Utility runs (train_utility): Algorithms 1 and 2 on the [utility] data set with the paper's fully connected ReLU
network (model "mlp"), vectorised across participants (protocols/cgd_training.py). T = [utility] training_rounds, alpha =
[utility] server_lr, m = `partition`; the returned accuracy is the worst evaluated confined model (the paper reports the
worst), baseline_accuracy is centralized training (the same protocol with one participant: full-batch gradient
descent on all the data, the same init law, T and alpha). With a client defense other than "none" (DP-SGD inside
CGD) the run goes participant by participant through run_rounds instead (`train_per_participant`, horizontal
partitions only): the same models as the engine on the same seed (tests/test_protocols.py), at m times the cost.

Reading of Algorithm 2 (ambiguous in the paper; `vertical`, which only matters when a partition has cols > 1):
- "vfl" (default), vertical federated learning: the first-layer pre-activations of a sample are summed across the
  cols feature groups of its sample block by the secure sum, each participant continues from that sum with its own
  upper layers, its own-block first-layer gradient is summed within its feature group l_j and the upper layers
  across all; each sample block's models are evaluated on all features. This reading gives the paper's vertical
  results, which equal its horizontal ones at the same m^h (Tables 3 and 8). Privacy cost: an extra wire, the
  secure sum of each block's partial pre-activations (samples x H_1 per block and iteration) revealed to the
  block's participants and to the aggregator; colluders in a block learn the honest members' summed partial
  pre-activations of every sample of the block. It is a large cost, and needs no colluder: a sample's summed
  pre-activation is z_k = x (W_1 + O_k) + b_1 + o_k, its block's confined init W_1, b_1 secret but fixed and the
  offsets O_k, o_k public (minus the step-weighted sums of the revealed group gradients), so z_k - z_1 is linear in
  x with known coefficients, (k - 1) H_1 equations for D features: after about D / H_1 + 1 iterations the
  aggregator solves for every training sample of every block (cgd_vertical.invert_preactivation_wire; tested:
  every sample of a toy partition within 0.05 per pixel after 30 iterations of the fixed-point wire). The wire also
  shows the number of samples of each block (one row each). The horizontal protocol (Algorithm 1) reveals only the
  gradient sums. Attack trials observe this wire with `split_features` (below).
- "literal": lines 7-8 read literally, z = xi_(i,j) w^(1): each participant predicts from its own feature block, in
  training and in evaluation. Only the gradient sums cross the wire; accuracy stays at local-training level.
Attack trials run Algorithm 1 by default (the case's clients hold whole samples), where the two readings coincide.
With split_features = true they run Algorithm 2 in the vfl reading (protocols/cgd_vertical.py): each of the case's
clients is a sample block of the partition's cols feature-block participants (m = clients x cols), a block's update
is its share of the secure sums in the plain MLP's layout, and the observer's view carries the wire (meta
"preactivations": the victim block's summed pre-activations; "first_offset": the public first-layer offset they
were computed at), which attacks/preactivation_inversion.py solves. Colluders are then whole sample blocks other than
the victim's (default all of them, t = m - cols); the proxy model is one participant's model of a colluding block.

Defaults: delta = 0.1 (MNIST), init_law = "interval" (every initial weight in [-delta, delta]), one delta for all
(delta_high sets the range of per-participant draws, e.g. delta = 0.001 with delta_high = 0.1), mu = 0 (fixed alpha,
section 7.1), 24 fractional bits. Known deviations: the paper's CIFAR-10 head and MNIST are not used here
(Fashion-MNIST is, the offline default); `secure_sum = "float"` trades the fixed-point rounding for speed and is
named in the results where used.
"""
from __future__ import annotations

import copy
import json
import time
from typing import Any, Literal

import torch
from gleak.protocols.cgd_training import INIT_LAWS, VERTICAL_READINGS, Partition, blocks, init_unit, step_size, train
from gleak.protocols.cgd_utility import centralized, features, mlp_sizes, subset, train_per_participant
from gleak.protocols.cgd_vertical import VerticalBlock, block_update, draw_block, step_block, zero_block
from torch import nn

from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Defense, check_choice
from gleak.contracts.registry import register_protocol
from gleak.contracts.seeds import derive_seed
from gleak.contracts.wire import ClientBatch, Update
from gleak.mechanics.client_update import shift_each, shifted
from gleak.mechanics.models import first_linear
from gleak.mechanics.protocol import Protocol
from gleak.mechanics.secret_sharing import FixedPoint, secure_sum, sum_encoded

# The share protocol costs parties^2 ring elements per coordinate; beyond this many in all, the bit-identical sum
# of encodings is used instead (gleak.mechanics.secret_sharing.sum_encoded).
SHARE_BUDGET = 1 << 28
_RUN_CACHE: dict[str, dict[str, Any]] = {}  # one utility run per configuration and process (train_utility)
ALGORITHM2_READINGS = {
    "vfl": "Algorithm 2 as vertical FL: a sample block's pre-activations summed across its feature groups by the secure sum; models evaluated on all features",
    "literal": "Algorithm 2 read literally: each participant predicts from its own feature block",
}


def _redraw(module: nn.Module, delta: float, rng: torch.Generator, law: str) -> nn.Module:
    """A copy of `module` with every parameter drawn delta * Rand (equation 11; Rand of cgd_training.init_unit)."""
    out = copy.deepcopy(module)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(init_unit(p.shape, rng, law).to(p.dtype) * delta)
    return out


class _ConfinedTraining(Protocol):
    """Parameters and utility training shared by CGD and its local-training baseline."""

    _mode: str = "cgd"

    def _check_common(self, partition, delta, delta_high, frac_bits, train_samples, eval_participants, inputs, init_law):
        check_choice("init_law", init_law, INIT_LAWS)
        Partition.parse(partition)
        check_choice("inputs", inputs, ("pixels", "standardized"))
        if not delta > 0:
            raise ValueError(f"delta must be > 0, got {delta}")
        if delta_high is not None and not delta_high > delta:
            raise ValueError(f"delta_high must be > delta ({delta}), got {delta_high}")
        FixedPoint(frac_bits)
        if train_samples is not None and train_samples < 1:
            raise ValueError(f"train_samples must be >= 1, got {train_samples}")
        if eval_participants < 1:
            raise ValueError(f"eval_participants must be >= 1, got {eval_participants}")

    # The parameters that shape a utility run (the others concern attack trials only).
    _utility_params = ("partition", "delta", "delta_high", "mu", "normalize_schedule", "grad_scale", "secure_sum",
                       "frac_bits", "train_samples", "eval_participants", "inputs", "confined", "vertical",
                       "utility_seed", "init_law")  # fmt: skip

    @classmethod
    def identity_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters as stored in trial and utility ids. Added after the first release, and left out where
        they change nothing, so that earlier ids stay valid: utility_seed when None (the [utility] seed), split_features
        when false;
        vertical on a partition with one feature block (the readings coincide there). On a partition with feature
        blocks both readings are stored: a stored "literal" left out would be rebuilt with the default "vfl"
        (gleak.contracts.registry checks that the stored form rebuilds itself), so the literal rows stored before the
        parameter existed were re-keyed, not reused."""
        out = dict(params)
        if out.get("utility_seed", 0) is None:
            del out["utility_seed"]
        if out.get("split_features", True) is False:
            del out["split_features"]
        if "vertical" in out:
            try:
                cols = Partition.parse(out.get("partition", "10x1")).cols
            except ValueError:
                cols = 1  # the plugin's own check names the bad partition
            if cols == 1:
                del out["vertical"]
        return out

    shared_model = per_client_models = False  # every participant computes at its own confined model
    observes_sum = True  # the aggregator reads the secure sum of the honest participants, never one of them
    models_held = "each participant draws and steps its own confined model; the server sends none"

    def train_utility(
        self, config: Any, train_ds: Any, test_ds: Any, rng: torch.Generator,
        defense: tuple[str, dict[str, Any]] = ("none", {}), on_round: Any = None,
    ) -> dict[str, Any]:  # fmt: skip
        if defense[0] != "none":  # a client defense inside CGD: participant by participant (run_rounds)
            return train_per_participant(self, config, train_ds, test_ds, defense)
        # Configurations that differ only in attack-trial parameters train identically: once per process.
        mine = {k: getattr(self, k) for k in self._utility_params if hasattr(self, k)}
        key = json.dumps([self._mode, mine, config.to_dict(), train_ds.name, len(train_ds)], sort_keys=True, default=str)
        if key not in _RUN_CACHE:
            _RUN_CACHE[key] = self._train_utility(config, train_ds, test_ds)
        return dict(_RUN_CACHE[key])

    def _train_utility(self, config: Any, train_ds: Any, test_ds: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        sizes = mlp_sizes(config, train_ds)
        seed = config.seed if self.utility_seed is None else self.utility_seed
        x, y = subset(train_ds, self.train_samples, seed, self.inputs)
        x_test, y_test = features(test_ds, slice(None), self.inputs), test_ds.y
        part = Partition.parse(self.partition)
        if part.rows > len(y):
            raise UnsupportedCase(f"partition {part} has more sample blocks than the {len(y)} training samples")
        common = dict(
            sizes=sizes, iterations=config.training_rounds, alpha=config.server_step, mu=self.mu, normalize_schedule=self.normalize_schedule,
            delta=self.delta, delta_high=self.delta_high, grad_scale=self.grad_scale, frac_bits=self.frac_bits,
            seed=derive_seed(seed, "cgd"), progress=True, init_law=self.init_law,
        )  # fmt: skip
        base = centralized(x, y, x_test, y_test, common)
        if not getattr(self, "confined", True):
            # Federated SGD with the secure sum and one shared model, full batch: every participant's gradient is
            # taken at the same model, so their sum is the full-batch gradient: centralized training.
            res = base
        else:
            res = train(x, y, x_test, y_test, partition=part, mode=self._mode, secure_sum=self.secure_sum,
                        eval_participants=self.eval_participants, vertical=getattr(self, "vertical", "literal"),
                        **common)  # fmt: skip
        return {
            "accuracy": res.accuracy, "baseline_accuracy": base.accuracy, "epsilon": None,
            "seconds": time.perf_counter() - t0,
            "mean_accuracy": res.mean_accuracy, "best_accuracy": res.best_accuracy, "loss": res.loss,
            "mean_loss": res.mean_loss, "baseline_loss": base.loss, "participants": res.participants,
            "evaluated": res.evaluated, "iterations": res.iterations, "train_samples": len(y),
            "seconds_per_iteration": res.seconds_per_iteration,
            "baseline_seconds_per_iteration": base.seconds_per_iteration,
            "reading": ALGORITHM2_READINGS[getattr(self, "vertical", "literal")] if part.cols > 1 else "",
            "utility_seed": seed,
        }  # fmt: skip


@register_protocol("cgd", as_defense=True)
class CGD(_ConfinedTraining):
    """Confined Gradient Descent (Zhang, Bai, Li, Nepal and Ko): private confined models, summed gradients by secret sharing over Z_2^32.

    Parameters
    ----------
    partition: utility runs: "rows x cols" participants, rows sample blocks by cols feature blocks ("10x1" is
        Algorithm 1 with 10 participants, "10x7" Algorithm 2). Attack trials take the sample blocks from the case
        (clients, batch_size) and run Algorithm 1, or Algorithm 2 on the partition's cols with split_features.
    delta: init scale delta of w_1 = delta Rand (default 0.1, the paper's MNIST setting).
    init_law: Rand, the unit init law (an ambiguity of the paper, cgd_training.init_unit): "interval" (default:
        w_1 ~ N[-delta, delta] read as N(0, 1) truncated to [-1, 1], every initial weight in [-delta, delta]) or
        "gaussian" (equation 11 with N(0, 1) untruncated; the only law before this parameter existed).
    delta_high: when set, each participant draws its own delta uniformly from [delta, delta_high] (Table 7 "Random").
    mu, normalize_schedule: step schedule alpha_k (see cgd_training.step_size): mu = 0 is a fixed alpha.
    grad_scale: "data" (default) or "local" (equation 5); see cgd_training.
    secure_sum: "protocol" (default: fixed-point over Z_2^32; attack trials run the share protocol) or "float".
    frac_bits: fractional bits of the fixed-point encoding (default 24; overflow raises EncodingOverflow).
    train_samples: utility runs on the first n samples of a seeded shuffle of the training split (None: all).
    eval_participants: utility runs evaluate every participant up to this many, else that many drawn at random.
    inputs: utility runs: "pixels" (default: [0, 1], as an MNIST FNN takes them; delta is relative to that scale) or
        "standardized" (gleak's mean/std normalisation, about 3x larger inputs on Fashion-MNIST).
    iterations: attack trials: CGD iterations the adversary observes (the last is attacked; all reach the attack).
    alpha: attack trials: the step size alpha of those iterations (utility runs use [utility] server_lr).
    colluders: attack trials: t colluding participants, the last t clients (default m - 2, the paper's worst case;
        with split_features whole sample blocks, a multiple of cols, default every block but the victim's).
    proxy: attack trials: the model the adversary holds, "colluder" (default) or "mean" (see the module docstring).
    confined: false = federated SGD with secure aggregation over the same clients (one shared model, observed).
    vertical: utility runs with feature blocks (cols > 1): the reading of Algorithm 2, "vfl" (default: a sample
        block's first-layer pre-activations summed across its feature groups by the secure sum, an extra wire) or
        "literal" (each participant predicts from its own feature block); see the module docstring.
    utility_seed: utility runs: the seed of the sample order and the confined inits (None: the [utility] seed), so
        that a suite can repeat a utility row over seeds.
    split_features: attack trials: split each client's samples into the partition's cols feature blocks (Algorithm 2
        in the vfl reading, protocols/cgd_vertical.py: m = clients x cols participants, the pre-activation wire
        reaches the observer). Default false: every client holds whole samples (Algorithm 1), whatever the partition.
    Also accepted as a defense (`[[defense]] name = "cgd"`), its historical spelling: CGD with no client transform.
    """

    conformance_params = {"iterations": 1}

    def __init__(
        self,
        partition: str = "10x1",
        delta: float = 0.1,
        delta_high: float | None = None,
        mu: float = 0.0,
        normalize_schedule: bool = False,
        grad_scale: Literal["data", "local"] = "data",
        secure_sum: Literal["protocol", "float"] = "protocol",
        frac_bits: int = 24,
        train_samples: int | None = None,
        eval_participants: int = 100,
        inputs: Literal["pixels", "standardized"] = "pixels",
        iterations: int = 1,
        alpha: float = 0.5,
        colluders: int | None = None,
        proxy: Literal["colluder", "mean"] = "colluder",
        confined: bool = True,
        vertical: Literal["vfl", "literal"] = "vfl",
        utility_seed: int | None = None,
        split_features: bool = False,
        init_law: Literal["interval", "gaussian"] = "interval",
    ):
        self._check_common(partition, delta, delta_high, frac_bits, train_samples, eval_participants, inputs, init_law)
        self.init_law = init_law
        if mu < 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        check_choice("grad_scale", grad_scale, ("data", "local"))
        check_choice("secure_sum", secure_sum, ("protocol", "float"))
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        if colluders is not None and colluders < 0:
            raise ValueError(f"colluders must be >= 0, got {colluders}")
        check_choice("proxy", proxy, ("colluder", "mean"))
        check_choice("vertical", vertical, VERTICAL_READINGS)
        if utility_seed is not None and utility_seed < 0:
            raise ValueError(f"utility_seed must be >= 0, got {utility_seed}")
        self.vertical, self.utility_seed, self.split_features = vertical, utility_seed, bool(split_features)
        self.partition, self.delta, self.delta_high = partition, delta, delta_high
        self.mu, self.normalize_schedule, self.grad_scale = mu, normalize_schedule, grad_scale
        self.secure_sum, self.frac_bits = secure_sum, frac_bits
        self.train_samples, self.eval_participants, self.inputs = train_samples, eval_participants, inputs
        self.iterations, self.alpha, self.colluders, self.proxy, self.confined = iterations, alpha, colluders, proxy, confined
        self.reset()

    # -- attack trials ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._models: list[nn.Module] = []
        self._extra: list[nn.Module] = []  # models the adversary moves along: its own draw, the mean proxy
        self._sum: Update | None = None
        self._k = 1
        self._offset: tuple[torch.Tensor, torch.Tensor] | None = None  # the public first-layer offset (split trials)

    def attack_cols(self) -> int:
        """Feature blocks per client in attack trials: the partition's cols with split_features, else 1."""
        return Partition.parse(self.partition).cols if self.split_features else 1

    def observed_clients(self, clients: int) -> int:
        """The honest sample blocks (the colluders' own are subtracted from the sum the adversary reads)."""
        return clients - self.colluders_at(clients) // self.attack_cols()

    def colluders_at(self, clients: int) -> int:
        """t colluding participants. Whole samples: the last t clients (default m - 2). Split features: whole sample
        blocks outside the victim's, t a multiple of cols (default all of them, m - cols)."""
        cols = self.attack_cols()
        m = clients * cols
        if cols == 1:
            t = m - 2 if self.colluders is None else self.colluders
            if m < 2 or t > m - 2:
                raise UnsupportedCase(f"CGD's adversary controls t <= m - 2 participants: m = {m}, t = {t}")
            return t
        t = m - cols if self.colluders is None else self.colluders
        if t % cols or t > m - cols:
            raise UnsupportedCase(f"colluders on a vertical partition are whole sample blocks other than the victim's "
                                  f"(t in 0, {cols}, ..., {m - cols}), got {t}")  # fmt: skip
        return t

    def _delta(self, rng: torch.Generator) -> float:
        if self.delta_high is None:
            return self.delta
        return self.delta + (self.delta_high - self.delta) * float(torch.rand((), generator=rng, dtype=torch.float64))

    def client_models(self, model: nn.Module, clients: int, rng: torch.Generator) -> list[nn.Module]:
        self.reset()
        self.colluders_at(clients)
        if self.attack_cols() > 1:
            return self._vertical_models(model, clients, rng)
        if self.confined:
            self._models = [_redraw(model, self._delta(rng), rng, self.init_law) for _ in range(clients)]
        else:
            self._models = [_redraw(model, self._delta(rng), rng, self.init_law)] * clients
        own = _redraw(model, self._delta(rng), rng, self.init_law)  # the adversary's own draw (proxy when t = 0)
        mean = _redraw(model, 0.0, rng, self.init_law)  # the init law's mean, zero
        self._extra = [own, mean]
        return list(self._models)

    def _vertical_models(self, model: nn.Module, clients: int, rng: torch.Generator) -> list[nn.Module]:
        cols = self.attack_cols()
        if self.vertical != "vfl":
            raise UnsupportedCase("attack trials with split_features run the vfl reading (vertical = 'vfl'); the "
                                  "literal reading's are not built")  # fmt: skip
        if not self.confined:
            raise UnsupportedCase("split_features with confined = false (federated SGD over feature blocks) is not built")
        found = first_linear(model)
        if not isinstance(model, nn.Sequential) or found is None or found[1].bias is None:
            raise UnsupportedCase("split_features needs the MLP (a Sequential whose first layer is an nn.Linear with bias)")
        d = found[1].in_features
        if cols > d:
            raise UnsupportedCase(f"{cols} feature blocks of {d} input features")
        feats = blocks(d, cols)
        law = self.init_law
        self._models = [draw_block(model, feats, [self._delta(rng) for _ in feats], rng, law) for _ in range(clients)]
        self._extra = [draw_block(model, feats, [self._delta(rng) for _ in feats], rng, law), zero_block(model, feats)]
        self._offset = (torch.zeros_like(found[1].weight.detach()), torch.zeros_like(found[1].bias.detach()))
        return list(self._models)

    def client_update(self, model: nn.Module, batch: ClientBatch, defense: Any, rng: torch.Generator) -> Update:
        if not isinstance(model, VerticalBlock):
            return super().client_update(model, batch, defense, rng)
        if type(defense).client_gradient is not Defense.client_gradient:
            raise UnsupportedCase("a client defense computing its own gradients (DP-SGD) inside a vertical CGD block is not built")
        return block_update(model, batch, self.secure_sum)

    def observed_rounds(self) -> int:
        return self.iterations

    def _sums(self, sent: list[Update], rng: torch.Generator | None, t: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(total, honest): the secure sum of all scaled gradients and the part of it of the first len(sent) - t
        (honest) clients, what the colluders recover by subtracting their own encodings. The share protocol runs
        when `rng` is given; without it the bit-identical sum of encodings (the server's own step)."""
        m = len(sent)
        if any(u.kind != "gradient" for u in sent):
            raise UnsupportedCase("CGD participants send gradients")
        n = sum(u.num_samples for u in sent)
        scale = [u.num_samples / n if self.grad_scale == "data" else 1.0 for u in sent]
        flats = torch.stack([u.flat().to(torch.float64) * s for u, s in zip(sent, scale)])
        honest = m - t
        if self.secure_sum == "float":
            return flats.sum(0), flats[:honest].sum(0)
        fp = FixedPoint(self.frac_bits)
        enc = fp.encode(flats, addends=m * self.attack_cols())
        share = rng is not None and m * m * enc.shape[1] <= SHARE_BUDGET
        ring = secure_sum(enc, rng) if share else sum_encoded(enc)
        # The colluders subtract their own encodings from the reconstructed sum: the honest participants' sum.
        seen_ring = ring - sum_encoded(enc[honest:]) if t else ring
        return fp.decode(ring), fp.decode(seen_ring)

    def observe(self, sent: list[Update], rng: torch.Generator) -> Update:
        t = self.colluders_at(len(sent))
        cols = self.attack_cols()
        total, seen = self._sums(sent, rng, t // cols)  # a colluding sample block is cols colluding participants
        honest = len(sent) - t // cols
        dtype = sent[0].flat().dtype
        self._sum = (sent, sent[0].with_flat(total.to(dtype)))  # the server's step uses this very sum
        meta = {"protocol": "cgd" if self.confined else "fedsgd+secure-sum", "participants": len(sent) * cols, "colluders": t}
        if cols > 1:  # the vfl wire: the victim block's summed pre-activations, and the public offset they were made at
            meta["preactivations"] = sent[0].meta["preactivations"]
            meta["first_offset"] = (self._offset[0].clone(), self._offset[1].clone())
        return Update(sent[0].with_flat(seen.to(dtype)).tensors, "gradient", sum(u.num_samples for u in sent[:honest]), meta)

    def server_step(self, models: list[nn.Module], sent: list[Update], lr: float, rng: torch.Generator) -> list[nn.Module]:
        """Every participant (and the adversary's proxies) steps its own model with alpha_k times the secure sum
        (CGD's public schedule; `lr` is not used)."""
        if self._sum is not None and self._sum[0] is sent:
            total = self._sum[1]
        else:
            tot, _ = self._sums(sent, None)
            total = sent[0].with_flat(tot.to(sent[0].flat().dtype))
        self._sum = None
        a = step_size(self._k, self.alpha, self.mu, self.iterations, self.normalize_schedule)
        self._k += 1
        if isinstance(models[0], VerticalBlock):
            out = [step_block(mod, total, a) for mod in models]
            self._extra = [step_block(mod, total, a) for mod in self._extra]
        else:  # a model shared by several clients (confined = false) steps once
            move = {name: -a * t for name, t in total.tensors.items()}
            out, self._extra = shift_each(models, move), shift_each(self._extra, move)
        self._models = out
        if self._offset is not None and out and isinstance(out[0], VerticalBlock):
            name = out[0].first_name  # every w_k - w_1 is minus the public sum of past steps
            self._offset = (self._offset[0] - a * total[f"{name}.weight"], self._offset[1] - a * total[f"{name}.bias"])
        return out

    def forged_step(self, models: list[nn.Module], displacement: dict[str, torch.Tensor]) -> list[nn.Module]:
        """One CGD iteration whose returned sum the aggregator forged, S* = -displacement / alpha_k: every
        participant (and the adversary's proxies) steps its own confined model by alpha_k S*, so each moves by
        `displacement`, and the iteration counter advances. Outside the paper's honest-but-curious adversary."""
        if self.attack_cols() > 1:
            raise UnsupportedCase("a forged CGD step over feature blocks (split_features) is not built")
        self._k += 1  # the forged round is an iteration: the schedule moves on
        out, self._extra = shift_each(models, displacement), shift_each(self._extra, displacement)
        self._models = out
        return out

    def observer_model(self, model: nn.Module, client_models: list[nn.Module]) -> nn.Module:
        if not self.confined:
            return client_models[0]  # the shared model: the observer knows it
        if self.proxy == "mean":
            held = self._extra[1]
        else:
            t = self.colluders_at(len(client_models))
            held = client_models[-1] if t else self._extra[0]
        # A vertical block's proxy: one of its participants' models (the block's first layer, that member's upper).
        return held.members[0] if isinstance(held, VerticalBlock) else held


@register_protocol("local-training", as_defense=True)
class LocalTraining(_ConfinedTraining):
    """The paper's local-training baseline (section 7.1): each participant trains on its own data alone.

    Utility runs only: the same partitions, init law and schedule as cgd (see its parameters; utility_seed too),
    without any sharing, so a participant learns from its own feature block only (there is no vertical reading);
    the accuracy is the worst evaluated participant's, baseline_accuracy centralized training. In an attack trial
    nothing leaves a participant, so the observer sees an all-zero update.
    """

    _mode = "local"

    def __init__(
        self,
        partition: str = "10x1",
        delta: float = 0.1,
        delta_high: float | None = None,
        train_samples: int | None = None,
        eval_participants: int = 100,
        inputs: Literal["pixels", "standardized"] = "pixels",
        utility_seed: int | None = None,
        init_law: Literal["interval", "gaussian"] = "interval",
    ):
        self._check_common(partition, delta, delta_high, 24, train_samples, eval_participants, inputs, init_law)
        self.init_law = init_law
        if utility_seed is not None and utility_seed < 0:
            raise ValueError(f"utility_seed must be >= 0, got {utility_seed}")
        self.utility_seed = utility_seed
        self.partition, self.delta, self.delta_high = partition, delta, delta_high
        self.train_samples, self.eval_participants, self.inputs = train_samples, eval_participants, inputs
        # Nothing is shared: no schedule decay, no secure sum; each participant steps with its own mean gradient.
        self.mu, self.normalize_schedule, self.grad_scale, self.secure_sum, self.frac_bits = 0.0, False, "local", "float", 24

    def observe(self, sent: list[Update], rng: torch.Generator) -> Update:
        return sent[0].map(lambda _, t: torch.zeros_like(t))

    def forged_step(self, models: list[nn.Module], displacement: dict[str, torch.Tensor]) -> list[nn.Module]:
        raise UnsupportedCase("local training shares nothing: there is no aggregate to forge")

    def server_step(self, models: list[nn.Module], sent: list[Update], lr: float, rng: torch.Generator) -> list[nn.Module]:
        """Each participant steps its own model with its own update (nothing is shared)."""
        return [shifted(mod, {name: -lr * t for name, t in u.tensors.items()}) for mod, u in zip(models, sent)]
