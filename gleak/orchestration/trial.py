"""One trial, end to end. This file is the whole flow of the benchmark, one way:

    suite -> trial config -> case (data, model, seed) -> protocol and client defense (gleak.mechanics.protocol_setup.trial_setup)
    -> warm-up rounds (case.warmup_rounds, run_rounds) -> [a label query round; a forged aggregate's round, where
    the attack needs them] -> attack.prepare, prepare_clients (gleak.mechanics.gate.served_models: active
    attacks build the models the server sends, one per client where the protocol lets it)
    -> observed rounds (run_rounds: client update -> defense transform -> wire -> protocol's view)
    -> gate (gleak.mechanics.gate: the observation from the wire and the attack's needs) -> attack.reconstruct
    -> score -> row for the store
"""
from __future__ import annotations

import math
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gleak.contracts.attack_output import baseline_torch_state
from gleak.contracts.config import TrialConfig
from gleak.contracts.errors import UnsupportedCase
from gleak.contracts.plugin import Attack, Defense, soft_labels
from gleak.contracts.registry import create
from gleak.contracts.seeds import derive_seed, generator
from gleak.contracts.tags import get_tags
from gleak.contracts.wire import ClientBatch, Observation, Update, replace
from gleak.mechanics import device as devices
from gleak.mechanics.client_update import client_defense, fedavg_update, fedsgd_update
from gleak.mechanics.data import ImageDataset, sample_indices
from gleak.mechanics.defense_output import extra_json
from gleak.mechanics.gate import (  # noqa: F401 - observer_model: public here
    attacker_knowledge,
    forged_models,
    grant,
    observation,
    observer_model,
    served_models,
)
from gleak.mechanics.label_query import query_model, read_counts
from gleak.mechanics.metrics import relative_distance
from gleak.mechanics.modality import modality_of, victims_split
from gleak.mechanics.pretrain import build_model
from gleak.mechanics.progress import reporting
from gleak.mechanics.protocol import Protocol
from gleak.mechanics.protocol_setup import trial_setup
from gleak.mechanics.rounds import Schedule, run_rounds
from gleak.orchestration.store import NOT_APPLICABLE

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_case_data(cfg: TrialConfig, split: str = "train") -> ImageDataset:
    """A split of the case's data set, as its modality loads it (images, or token sequences: gleak.mechanics.modality)."""
    return modality_of(cfg.case).load(cfg.case, split)


def draw_batches(ds: ImageDataset, cfg: TrialConfig, dtype: torch.dtype, purpose: str = "data") -> list[ClientBatch]:
    """The victim's batch (first) and one batch for each other client, all from the trial's data stream."""
    gen = generator(cfg.seed, purpose)
    c = cfg.case
    idx = sample_indices(len(ds), ds.y, c.batch_size * c.clients, gen, c.distinct_labels)
    out = []
    for i in range(c.clients):
        part = idx[i * c.batch_size : (i + 1) * c.batch_size]
        out.append(ClientBatch(ds.model_input(part, dtype), ds.y[part], ds.mean, ds.std))
    return out


def on_device(batches: list[ClientBatch]) -> list[ClientBatch]:
    """The batches on the device of the trial in progress (gleak.mechanics.device.use); themselves on the CPU."""
    if devices.current().type == "cpu":
        return batches
    return [replace(b, x=devices.to_device(b.x), y=devices.to_device(b.y)) for b in batches]


def client_update(
    model: nn.Module, batch: ClientBatch, cfg: TrialConfig, defense: Defense | None = None, client: int = 0, tag: str = ""
) -> Update:
    """Client `client`'s plain update under the case's legacy client computation (FedSGD, or FedAvg's local steps
    with case.update = "fedavg"), from the client's own generator: what conformance checks and the distance of a
    defended update to the plain one compute. Trials compute through their protocol (run_rounds)."""
    rng = generator(cfg.seed, f"client/{client}{tag}")
    if cfg.case.update == "fedavg":
        return fedavg_update(model, batch, cfg.case.local_lr, cfg.case.local_steps, defense=defense, rng=rng)
    return fedsgd_update(model, batch, defense, rng)


def _client_rngs(cfg: TrialConfig, tag: Callable[[int], str]) -> Callable[[int], list[torch.Generator]]:
    """Round r's generator of each client, named by `tag(r)`."""
    return lambda r: [generator(cfg.seed, f"client/{i}{tag(r)}") for i in range(cfg.case.clients)]


def warm_up_schedule(ds: ImageDataset, cfg: TrialConfig) -> Schedule:
    """The `case.warmup_rounds` honest rounds before the attacked one: a fresh batch per client and round, the clients'
    and the round's own generators (so adding rounds never changes the earlier ones)."""
    dtype = DTYPES[cfg.case.dtype]
    return Schedule(
        lambda r: on_device(draw_batches(ds, cfg, dtype, f"data/round-{r}")),
        _client_rngs(cfg, lambda r: f"/round-{r}"),
        lambda r: generator(cfg.seed, f"defense/round-{r}"),
    )  # fmt: skip


def observed_schedule(batches: list[ClientBatch], cfg: TrialConfig) -> Schedule:
    """The observed rounds: every round on the clients' attacked batches (a CGD participant's whole local data);
    the wire's generator runs on across rounds, each client draws afresh each round."""
    wire = generator(cfg.seed, "defense")
    batches = on_device(batches)
    return Schedule(lambda r: batches, _client_rngs(cfg, lambda r: f"/observed-{r}" if r else ""), lambda r: wire)


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def execute(cfg: TrialConfig, lpips_weights: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Run one trial and return its metrics (raises on failure). See `run_trial` for the stored row. `device`
    (resolved, gleak.mechanics.device.resolve): where the rounds and the attack compute; data, model building and scoring
    stay on the CPU."""
    dtype = DTYPES[cfg.case.dtype]
    ds = load_case_data(cfg)
    held_out = victims_split(cfg.case) == "test"
    pool = load_case_data(cfg, "test") if held_out else ds
    batches = draw_batches(pool, cfg, dtype)
    victim = batches[0]
    attack: Attack = create("attack", cfg.attack, **cfg.attack_params)
    setup = trial_setup(cfg.case, cfg.defense, cfg.defense_params)
    protocol: Protocol = create("protocol", setup.protocol, **setup.protocol_params)
    # the clients' normalisation: the victims' split is normalised alike
    defenses: list[Defense] = [client_defense(setup.defense, setup.defense_params, ds.mean, ds.std, ds.num_classes)
                               for _ in batches]  # fmt: skip
    grant(attack, protocol, cfg.attack, setup.protocol, cfg.threat_model)
    public = load_case_data(cfg, "train" if held_out else "test") if "public_data" in get_tags(attack).needs else None
    knowledge = attacker_knowledge(attack, ds, victim, public, setup)

    # untrained, or trained first (cached); wrapped by the defense where it changes the model (PRECODE's bottleneck)
    model, model_info = build_model(cfg.case, ds, cfg.seed, dtype, defenses[0], (cfg.identity()["defense"], cfg.defense_params))
    with devices.use(device):
        model = devices.to_device(model)
        last, rec, plain, sent = _rounds_and_attack(cfg, attack, protocol, defenses, model, knowledge, ds, batches)
        grad_dist = relative_distance(plain.flat(), last.view.flat())
    # Checked, scored and kept as the case's modality says (images: against the mean image; text: ROUGE).
    observed = batches[: protocol.observed_clients(len(batches))]  # the samples behind what the attack saw
    done = modality_of(cfg.case).finish(cfg, ds, pool, observed, sent, rec, model_info,
                                        defenses[0].privacy_spent(),  # the victim's accountant, stepped with its noisy steps
                                        lpips_weights, last.at[0],
                                        get_tags(defenses[0]).scored_against)  # fmt: skip
    scores = done.scores
    scores["grad_dist"] = grad_dist
    extra = scores.pop("extra")
    extra["device"] = device
    scores["extra"] = {k: _finite_or_none(v) for k, v in extra.items()}
    scores["_images"] = done.images
    scores["_arrays"] = done.arrays
    return scores


def sent_batch(victim: ClientBatch, kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> ClientBatch:
    """The victim's batch as it entered its gradient in the attacked round, from the (given x, x', y') its
    transforming defense kept (Defense.training_batch): each image's first transformed version (FedSGD computes
    one gradient; FedAvg's later local steps draw their own). On the CPU."""
    if kept and torch.equal(kept[0][0], victim.x):
        x, y = kept[0][1], kept[0][2]
    else:
        xs, ys = [], []
        for i in range(victim.size):
            hit = next(((xb[j], yb[j]) for x0, xb, yb in kept for j in range(len(x0)) if torch.equal(x0[j], victim.x[i])), None)
            if hit is None:
                raise RuntimeError(f"the defense declares a transform of its inputs but kept none of victim image {i}")
            xs.append(hit[0])
            ys.append(hit[1])
        x, y = torch.stack(xs), torch.stack(ys)
    if x.shape != victim.x.shape or y.shape != victim.y.shape and not soft_labels(y, len(victim.y)):
        raise RuntimeError(f"the defense's gradient_batch returned shapes {tuple(x.shape)}, {tuple(y.shape)}; "
                           f"expected the client's {tuple(victim.x.shape)}, {tuple(victim.y.shape)}")  # fmt: skip
    return replace(victim, x=x.detach().cpu(), y=y.detach().cpu())


def _rounds_and_attack(cfg, attack, protocol, defenses, model, knowledge, ds, batches):
    """The rounds, the gate and the attack, on the current device: (the attacked round, the reconstruction, the
    victim's plain update in that round, the victim's batch as sent where its defense transforms it, else None)."""
    victim = on_device(batches[:1])[0]
    protocol.reset()
    models = protocol.client_models(model, len(batches), generator(cfg.seed, "client-models"))
    models, warm = run_rounds(protocol, defenses, models, cfg.case.warmup_rounds, warm_up_schedule(ds, cfg), cfg.case.warmup_lr)
    tags, server = get_tags(attack), get_tags(protocol)
    if server.shared_model and "label_counts" in tags.needs:  # the active server's first query
        knowledge = replace(knowledge, label_counts=label_query(cfg, protocol, defenses, models[0], batches, knowledge))
    if "forged_aggregate" in tags.needs:  # one round whose aggregate the adversary forged (outside honest-but-curious)
        models = forged_models(attack, protocol, models, knowledge, cfg.seed)
    if server.shared_model:  # the server sends its models; an active attack builds them (new modules)
        models = served_models(attack, models[0], len(batches), knowledge, cfg.seed)
    transforming = get_tags(defenses[0]).transforms_inputs
    kept: list = []
    if transforming:  # the victim's defense keeps the batches it trains on; only the attacked (last) round's count
        defenses[0].kept_batches = kept
    n_obs = protocol.observed_rounds()
    models, seen = run_rounds(protocol, defenses, models, n_obs, observed_schedule(batches, cfg), cfg.case.warmup_lr,
                              step_last=False, on_round=lambda r, _: kept.clear() if r < n_obs - 1 else None)  # fmt: skip
    defenses[0].kept_batches = None
    sent = sent_batch(batches[0], [tuple(t.cpu() for t in k) for k in kept]) if transforming else None
    if sent is not None and knowledge.labels is not None:  # the labels the gradient was computed with (MixUp's soft ones)
        knowledge = replace(knowledge, labels=sent.y.clone().to(knowledge.labels.device))
    history: tuple[Observation, ...] = ()
    for w in [*warm, *seen[:-1]]:  # every round the observer saw passes the gate
        history = (*history, observation(w.view, w.held, attack, knowledge, cfg.seed))
    last = seen[-1]
    rec = attack.reconstruct(observation(last.view, last.held, attack, knowledge, cfg.seed, history),
                             generator(cfg.seed, "attack"))  # fmt: skip
    # The distance is to the plain update, so that a defense acting inside the client's computation (DP-SGD) counts.
    own = type(defenses[0]).client_gradient is not Defense.client_gradient or transforming
    plain = last.updates[0] if not own else \
        protocol.client_update(last.at[0], victim, create("defense", "none"), generator(cfg.seed, "client/0"))  # fmt: skip
    if sent is not None and torch.equal(sent.x, batches[0].x):
        sent = None  # the transform left the batch as it was: one truth
    return last, rec, plain, sent


def label_query(cfg, protocol, defenses, model, batches, knowledge) -> torch.Tensor:
    """The label counts behind the observed update, read from one query round at a model whose classifier the server
    zeroed (gleak.mechanics.label_query): the clients compute on their attacked batches, under their defenses, from
    generators of the query's own."""
    query = query_model(model, knowledge.num_classes)
    schedule = Schedule(lambda r: on_device(batches), _client_rngs(cfg, lambda r: "/query"),
                        lambda r: generator(cfg.seed, "defense/query"))  # fmt: skip
    _, seen = run_rounds(protocol, defenses, [query] * len(batches), 1, schedule, cfg.case.warmup_lr, step_last=False)
    return read_counts(seen[-1].view, query, knowledge.num_classes, knowledge.batch_size or cfg.case.batch_size)


def run_trial(
    cfg: TrialConfig, lpips_weights: str | None = None, image_dir: str | Path | None = None, on_images: Any = None,
    device: str = "cpu", progress: Any = None,
) -> dict[str, Any]:
    """Run one trial and return its row for the store. Never raises for a failing trial: the row says why.
    on_images(truth, reconstruction), when given, receives the trial's images in [0, 1] (gleak.api keeps them).
    device: a resolved device name (gleak.mechanics.device.resolve), recorded in the row's extra; not part of the trial id.
    progress: where the attack's iterations go (a gleak.mechanics.progress sink; None: nowhere)."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"trial_id": cfg.trial_id, "config": cfg.to_json(), "status": "ok", "error": None}
    try:
        # fork_rng and the baseline state: a plugin that touches torch's global state cannot leak into the next trial
        with torch.random.fork_rng(devices=[]), baseline_torch_state(), reporting(progress):
            torch.manual_seed(derive_seed(cfg.seed, "global"))
            scores = execute(cfg, lpips_weights, device)
        truth, rec = scores.pop("_images")
        if on_images is not None:
            on_images(truth, rec)
        arrays = scores.pop("_arrays")
        if arrays is not None and arrays[2] is not None:  # kept as arrays, so that `gleak rescore` recomputes metrics without the attack
            from gleak.orchestration.reconstructions import pack

            row["reconstruction"] = pack(*arrays)
        if image_dir is not None and rec is not None:
            from gleak.orchestration.images import save_reconstruction

            path = Path(image_dir) / f"{cfg.trial_id}.png"
            save_reconstruction(truth, rec, path)
            scores["image"] = str(path.name)
        for k in ("psnr", "mse", "ssim", "lpips", "cosine", "grad_dist"):
            v = scores.get(k)
            if isinstance(v, float) and math.isnan(v):
                raise FloatingPointError(f"metric {k} is NaN")
        scores["extra"] = extra_json(scores.get("extra"), f"attack {cfg.attack!r}")
        row.update(scores)
    except UnsupportedCase as exc:  # the plugin cannot handle this case: not applicable, not a failure
        row.update(status=NOT_APPLICABLE, error=_one_line(exc), extra=extra_json({"device": device}))
    except Exception as exc:  # noqa: BLE001 - a failing trial is data, not a crash
        row.update(status="failed", error=_one_line(exc), traceback=traceback.format_exc(limit=8),
                   extra=extra_json({"device": device}))
    row["seconds"] = time.perf_counter() - t0
    return row
