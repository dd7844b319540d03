"""Trial configuration: the case (data, model, protocol) and one trial (case x attack x defense x seed).

A trial's result is a function of its TrialConfig alone; `trial_id` is a hash of all of it (suite name excluded,
so two suites that ask for the same trial share it).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from gleak.contracts.vocabulary import is_text_dataset, text_vocab_digest

# Bump when a change to gleak alters what an existing config computes, so that stored results are not reused.
TRIAL_FORMAT = 1

# Renamed keys, old spelling -> current name ("rounds" meant three things). Suites and the API accept the old
# spelling (both at once is an error); stored configs, trial ids and utility ids keep the old one, so that stored
# results stay valid and no published file changes. The three kinds of rounds: a case's warm-up rounds
# (CaseConfig.warmup_rounds), a protocol's observed rounds (Protocol.observed_rounds()), a utility run's training
# rounds (UtilityConfig.training_rounds).
CASE_RENAMED = {"rounds": "warmup_rounds"}
UTILITY_RENAMED = {"rounds": "training_rounds"}


def current_names(raw: dict[str, Any], renamed: dict[str, str]) -> dict[str, Any]:
    """raw with old spellings replaced by the current names, in place of the old key (order kept). A key given in both
    spellings raises KeyError(old spelling, message)."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        new = renamed.get(k)
        if new is not None and new in raw:
            raise KeyError(k, f"is the old name of {new}: give {new} only")
        out[new or k] = v
    return out


def stored_names(d: dict[str, Any], renamed: dict[str, str]) -> dict[str, Any]:
    """d with current names written in their stored (first) spelling, order kept."""
    back = {new: old for old, new in renamed.items()}
    return {back.get(k, k): v for k, v in d.items()}


@dataclass(frozen=True)
class CaseConfig:
    """Everything about a trial except the attack, the defense and the seed. Keys of a suite's [case] table."""

    dataset: str = "skimage"
    model: str = "mlp"
    model_params: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1
    resolution: int | None = None  # resize images to resolution x resolution
    channels: int | None = None  # convert to 1 (grey) or 3 (RGB) channels
    dtype: Literal["float32", "float64"] = "float32"
    data_root: str | None = None
    download: bool = False
    distinct_labels: bool = False  # draw batches with no repeated label
    clients: int = 1  # clients in the attacked round; the victim is client 0
    update: Literal["fedsgd", "fedavg"] = "fedsgd"
    local_steps: int = 1  # fedavg only
    local_lr: float = 0.1  # fedavg's local SGD step (deprecated meaning, FedSGD cases: the warm-up server step)
    warmup_rounds: int = 0  # rounds the clients train under the defense before the observed ones (stored as "rounds")
    # The server's step on the mean FedSGD gradient in warm-up rounds (None: local_lr, its historical spelling).
    server_lr: float | None = None
    # The attacked model (gleak.mechanics.pretrain): "untrained" (fresh init from the trial seed), "trained" first for
    # train_steps SGD steps on the case's training split (one trained model per case, whatever the trial seed), or
    # "file:PATH", a state dict the user saved (torch.save(model.state_dict(), PATH); read with weights_only=True).
    model_state: str = "untrained"
    train_steps: int = 500
    train_lr: float = 0.01
    train_batch_size: int = 32
    train_seed: int = 0
    model_mode: Literal["train", "eval"] = "train"  # BatchNorm statistics when the client computes its update
    # The round protocol (a gleak.mechanics.protocol.Protocol plugin) and its parameters; "fedsgd" unless named (or selected
    # by the legacy keys: update = "fedavg", or a protocol named as a defense such as [[defense]] name = "cgd").
    protocol: str = "fedsgd"
    protocol_params: dict[str, Any] = field(default_factory=dict)
    # Text data sets (gleak.contracts.vocabulary): tokens per sequence (None: DEFAULT_SEQ_LEN) and the tokenizer's vocabulary
    # size (None: DEFAULT_VOCAB_SIZE). Images leave them unset.
    seq_len: int | None = None
    vocab_size: int | None = None

    # Fields added after TRIAL_FORMAT 1: part of a trial's identity only when set, so existing trial ids stay valid.
    LATER_FIELDS: ClassVar[dict[str, Any]] = {
        "rounds": 0, "model_state": "untrained", "train_steps": 500, "train_lr": 0.01, "train_batch_size": 32,
        "train_seed": 0, "model_mode": "train", "protocol": "fedsgd", "protocol_params": {}, "server_lr": None,
        "seq_len": None, "vocab_size": None,
    }

    @property
    def warmup_lr(self) -> float:
        """The server's step in warm-up rounds: server_lr, else local_lr (its historical spelling)."""
        return self.local_lr if self.server_lr is None else self.server_lr

    def to_dict(self) -> dict[str, Any]:
        """The stored form (old spellings of renamed keys: CASE_RENAMED)."""
        return stored_names(dataclasses.asdict(self), CASE_RENAMED)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaseConfig":
        """From a stored or a user's dict (either spelling of renamed keys)."""
        return cls(**current_names(d, CASE_RENAMED))

    def identity(self) -> dict[str, Any]:
        d = self.to_dict()
        if d["server_lr"] is not None and d["update"] == "fedsgd":
            # server_lr is the new name of what local_lr meant in a FedSGD case: the same trial, the same id.
            d["local_lr"], d["server_lr"] = d["server_lr"], None
        return {k: v for k, v in d.items() if k not in self.LATER_FIELDS or v != self.LATER_FIELDS[k]}


CASE_FIELDS = {f.name: f for f in dataclasses.fields(CaseConfig)}


@functools.lru_cache(maxsize=64)
def _digest(path: str, _mtime_ns: int, _size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (recomputed when its size or modification time changes); '' for a missing file,
    which the suite's checks report."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return _digest(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def _wraps_model(defense: str) -> bool:
    """Whether the registered defense changes the architecture (overrides Defense.wrap_model)."""
    from gleak.contracts.plugin import Defense
    from gleak.contracts.registry import UnknownPluginError, plugin_info

    try:
        obj = plugin_info("defense", defense).obj
    except UnknownPluginError:  # the suite's checks report an unknown name, not the id
        return False
    return isinstance(obj, type) and issubclass(obj, Defense) and obj.wrap_model is not Defense.wrap_model


@dataclass(frozen=True)
class TrialConfig:
    suite: str
    attack: str
    attack_params: dict[str, Any]
    defense: str
    defense_params: dict[str, Any]
    case: CaseConfig
    seed: int
    # The suite's verdict rule (gleak.mechanics.verdicts.VERDICT_RULES): how the trial judges what it computed, stored with its
    # verdict; not part of what it computes, so not of its id.
    verdict: str = "margin"
    # The suite's threat model (gleak.contracts.threat_model: "B", "F+labels"); None: each attack is granted what it
    # declares where the protocol exposes it. Part of the id where set: it decides what the attack receives.
    threat_model: str | None = None

    def identity(self) -> dict[str, Any]:
        """What the trial computes: everything but the suite's name. Plugin names enter as their identity names,
        so that a renamed plugin (registered with its old name as an alias) keeps its trials' ids."""
        from gleak.contracts.registry import identity_name  # the registry does not import this module

        case = self.case.identity()
        if "protocol" in case:
            case["protocol"] = identity_name("protocol", case["protocol"])
        out = {
            "format": TRIAL_FORMAT,
            "attack": identity_name("attack", self.attack),
            "attack_params": self.attack_params,
            "defense": identity_name("defense", self.defense),
            "defense_params": self.defense_params,
            "case": case,
            "seed": self.seed,
        }
        if self.threat_model is not None:
            out["threat_model"] = self.threat_model
        if self.case.clients > 1:
            # Several clients: the reconstruction is paired one-to-one with every observed client's samples (the
            # victim's score and the share of all observed samples recovered); before that rule only the victim's
            # batch was matched, and labels reached attacks through a secure sum. Another computation, another id.
            out["observed"] = "every-client"
        if self.case.model_state.startswith("file:"):
            # The id follows the checkpoint's content, not only its path: new weights at the same path are new trials.
            out["model_file_sha256"] = file_digest(self.case.model_state[len("file:"):])
        if is_text_dataset(self.case.dataset):
            # A text case computes on the tokenizer built from its data: the vocabulary's hash, so that another
            # vocabulary (a new release of the data package) makes other trials.
            out["vocabulary_sha256"] = text_vocab_digest(self.case.dataset, self.case.data_root, self.case.vocab_size)
        if self.case.model_state == "trained":
            # A trained model's victims come from the split it never trained on (gleak.orchestration.trial); before that rule they
            # came from its training split. Another computation, so another id: stores never reuse the old rows.
            out["victims"] = "held-out"
            if _wraps_model(self.defense):
                # A defense that changes the architecture is trained with the model (gleak.mechanics.pretrain); before that rule
                # its wrapper was inserted untrained. Another computation, so another id.
                out["pretrained"] = "with-defense"
        return out

    @property
    def trial_id(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        rule = {} if self.verdict == "margin" else {"verdict": self.verdict}  # the default unwritten: older configs
        return json.dumps({"suite": self.suite, **self.identity(), **rule}, sort_keys=True, default=str)

    @staticmethod
    def from_json(text: str) -> "TrialConfig":
        d = json.loads(text)
        return TrialConfig(
            d["suite"], d["attack"], d["attack_params"], d["defense"], d["defense_params"], CaseConfig.from_dict(d["case"]), d["seed"],
            d.get("verdict", "margin"), d.get("threat_model"),
        )


@dataclass(frozen=True)
class UtilityConfig:
    """Keys of a suite's [utility] table: federated training on real data, the defense on every client's update,
    test accuracy against the same training without it (gleak.orchestration.utility)."""

    dataset: str = "fashion-mnist"
    model: str = "mlp"
    model_params: dict[str, Any] = field(default_factory=dict)
    data_root: str | None = None
    download: bool = False
    resolution: int | None = None
    channels: int | None = None
    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd"
    clients: int = 10  # all take part in every round; the train split is dealt into this many IID shards
    training_rounds: int = 200  # stored as "rounds"
    # Step sizes, one name per meaning (None: DEFAULT_LR). server_lr: the step on the aggregated gradient
    # (FedSGD: the server's step on the mean gradient; CGD: alpha, each participant's step on the secure sum).
    # client_lr: FedAvg's local SGD step (its server applies the mean delta at step 1). The first spelling `lr`
    # meant whichever of the two the algorithm uses: accepted (utility_lr_names), and stored configs (hence utility
    # ids) keep it, so no stored run moved.
    server_lr: float | None = None
    client_lr: float | None = None
    batch_size: int = 32  # per client and round (fedsgd) or per local step (fedavg)
    local_steps: int = 1  # fedavg only
    delta: float = 1e-5  # of the (epsilon, delta) reported for defenses that define one
    seed: int = 0
    # None: IID client shards; alpha > 0: label-skewed shards, a Dirichlet(alpha) share per class (gleak.mechanics.data.client_shards)
    dirichlet_alpha: float | None = None
    # Text data sets (as in CaseConfig): tokens per sequence and the vocabulary's size (None: their defaults).
    seq_len: int | None = None
    vocab_size: int | None = None

    # Fields added after UTILITY_FORMAT 1: in to_dict (hence the utility id) only when set, so stored runs stay valid.
    LATER_FIELDS: ClassVar[dict[str, Any]] = {"dirichlet_alpha": None, "seq_len": None, "vocab_size": None}

    def __post_init__(self):
        # The step the algorithm uses is concrete (DEFAULT_LR when not given), the other stays None, so that the
        # stored form round-trips and a step given for the wrong algorithm can be told apart (check_utility_values).
        used = "client_lr" if self.algorithm == "fedavg" else "server_lr"
        if getattr(self, used) is None:
            object.__setattr__(self, used, DEFAULT_LR)

    @property
    def server_step(self) -> float:
        """The step on the aggregated gradient (FedSGD's server step, CGD's alpha)."""
        return DEFAULT_LR if self.server_lr is None else self.server_lr

    @property
    def client_step(self) -> float:
        """FedAvg's local SGD step."""
        return DEFAULT_LR if self.client_lr is None else self.client_lr

    def to_dict(self) -> dict[str, Any]:
        """The stored form (old spellings of renamed keys: UTILITY_RENAMED; the step the algorithm uses as `lr`);
        the utility id hashes it."""
        d = stored_names(dataclasses.asdict(self), UTILITY_RENAMED)
        del d["server_lr"], d["client_lr"]
        d["lr"] = self.client_step if self.algorithm == "fedavg" else self.server_step
        return {k: v for k, v in d.items() if k not in self.LATER_FIELDS or v != self.LATER_FIELDS[k]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UtilityConfig":
        """From a stored or a user's dict (either spelling of renamed keys)."""
        return cls(**utility_lr_names(current_names(d, UTILITY_RENAMED)))


DEFAULT_LR = 0.1


def utility_lr_names(raw: dict[str, Any]) -> dict[str, Any]:
    """A [utility] table with its first spelling `lr` written as the step it meant for the table's algorithm
    (server_lr for FedSGD, client_lr for FedAvg). `lr` beside that name raises KeyError("lr", message)."""
    if "lr" not in raw:
        return raw
    algorithm = raw.get("algorithm", "fedsgd")
    new = "client_lr" if algorithm == "fedavg" else "server_lr"
    if new in raw:
        raise KeyError("lr", f"is the old name of {new} (algorithm {algorithm!r}): give {new} only")
    return {(new if k == "lr" else k): v for k, v in raw.items()}


UTILITY_FIELDS = {f.name: f for f in dataclasses.fields(UtilityConfig)}
