"""One trial, end to end. This file is the whole flow of the benchmark:

    case (data, model, seed) -> warm-up rounds (case.rounds, under the defense) -> attack.prepare (active attacks
    modify the model) -> client update(s)
    -> defense (transform; protocol decides what the observer sees) -> observation -> attack.reconstruct
    -> match + score -> row for the store
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gleak.config import TrialConfig, derive_seed, generator
from gleak.data import ImageDataset, load_dataset, sample_indices
from gleak.metrics import mean_image, relative_distance, score
from gleak.plugin import Attack, Defense
from gleak.pretrain import build_model
from gleak.protocol import fedavg_update, fedsgd_update, send_round, server_step, transmit
from gleak.registry import create
from gleak.threat import ClientBatch, Knowledge, Observation, Update, denormalize

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_case_data(cfg: TrialConfig, split: str = "train") -> ImageDataset:
    c = cfg.case
    return load_dataset(
        c.dataset, split, root=c.data_root, resolution=c.resolution, channels=c.channels, download=c.download
    )


def draw_batches(ds: ImageDataset, cfg: TrialConfig, dtype: torch.dtype, purpose: str = "data") -> list[ClientBatch]:
    """The victim's batch (first) and one batch for each other client, all from the trial's data stream."""
    gen = generator(cfg.seed, purpose)
    c = cfg.case
    idx = sample_indices(len(ds), ds.y, c.batch_size * c.clients, gen, c.distinct_labels)
    out = []
    for i in range(c.clients):
        part = idx[i * c.batch_size : (i + 1) * c.batch_size]
        out.append(ClientBatch(ds.normalized(part).to(dtype), ds.y[part], ds.mean, ds.std))
    return out


def attacker_knowledge(attack: Attack, ds: ImageDataset, victim: ClientBatch, public: ImageDataset | None) -> Knowledge:
    """Exactly what the attack's `needs` grant it, and nothing more."""
    needs = attack.needs
    return Knowledge(
        input_shape=ds.input_shape,
        num_classes=ds.num_classes,
        batch_size=victim.size if "batch_size" in needs else None,
        mean=ds.mean if "data_stats" in needs else None,
        std=ds.std if "data_stats" in needs else None,
        labels=victim.y.clone() if "labels" in needs else None,
        public_x=public.normalized().to(victim.x.dtype) if public is not None else None,
        public_y=public.y if public is not None else None,
    )


def observer_model(attack: Attack, model: nn.Module, cfg: TrialConfig) -> nn.Module | None:
    """The attacker's copy of the model: structure if it needs the architecture, weights only if it needs them."""
    if "architecture" not in attack.needs and "parameters" not in attack.needs:
        return None
    mine = copy.deepcopy(model)
    if "parameters" not in attack.needs:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "attacker-guess"))
            for m in mine.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    return mine


def client_update(
    model: nn.Module, batch: ClientBatch, cfg: TrialConfig, defense: Defense | None = None, client: int = 0, tag: str = ""
) -> Update:
    """Client `client`'s update; its gradients come from the defense's `client_gradient` hook (plain by default),
    which draws from the client's own generator (`tag` names the round for the warm-up rounds)."""
    rng = generator(cfg.seed, f"client/{client}{tag}")
    if cfg.case.update == "fedavg":
        return fedavg_update(model, batch, cfg.case.local_lr, cfg.case.local_steps, defense=defense, rng=rng)
    return fedsgd_update(model, batch, defense, rng)


def warm_up(
    model: nn.Module, defenses: list[Defense], ds: ImageDataset, cfg: TrialConfig, attack: Attack, knowledge: Knowledge
) -> tuple[nn.Module, tuple[Observation, ...]]:
    """The `case.rounds` honest rounds before the attacked one: each round every client sends its defended update on
    a fresh batch, the server applies the mean of what was sent, and stateful defenses (error feedback) carry their
    state on. Returns the global model the attacked round starts from and what the observer saw in each round."""
    seen = []
    for r in range(cfg.case.rounds):
        batches = draw_batches(ds, cfg, DTYPES[cfg.case.dtype], f"data/round-{r}")
        updates = [client_update(model, b, cfg, d, i, f"/round-{r}") for i, (b, d) in enumerate(zip(batches, defenses))]
        rng = generator(cfg.seed, f"defense/round-{r}")
        sent = transmit(defenses, updates, rng)
        seen.append(Observation(defenses[0].observe(sent, rng), knowledge, observer_model(attack, model, cfg)))
        model = server_step(model, sent, cfg.case.local_lr)
    return model, tuple(seen)


def _one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def execute(cfg: TrialConfig, lpips_weights: str | None = None) -> dict[str, Any]:
    """Run one trial and return its metrics (raises on failure). See `run_trial` for the stored row."""
    dtype = DTYPES[cfg.case.dtype]
    ds = load_case_data(cfg)
    # A trained model is attacked on images it never trained on (Geiping et al. attack validation images): the
    # clients' batches come from the test split, and public data for the attacker from the training split.
    held_out = cfg.case.model_state == "trained"
    pool = load_case_data(cfg, "test") if held_out else ds
    batches = draw_batches(pool, cfg, dtype)
    victim = batches[0]
    attack: Attack = create("attack", cfg.attack, **cfg.attack_params)
    defenses: list[Defense] = [create("defense", cfg.defense, **cfg.defense_params) for _ in batches]
    for d in defenses:
        d.reset()
    public = load_case_data(cfg, "train" if held_out else "test") if "public_data" in attack.needs else None
    knowledge = attacker_knowledge(attack, ds, victim, public)

    model, model_info = build_model(cfg.case, ds, cfg.seed, dtype)  # untrained, or trained first (cached)
    model, history = warm_up(model, defenses, ds, cfg, attack, knowledge)
    model = attack.prepare(model, knowledge, generator(cfg.seed, "attack-prepare"))

    # The protocol decides where each client computes (CGD: its own confined model) and how many rounds are seen.
    protocol = defenses[0]
    rng = generator(cfg.seed, "defense")
    models = protocol.client_models(model, len(batches), generator(cfg.seed, "client-models"))
    seen: list[Observation] = []
    for r in range(protocol.observed_rounds()):
        if r:
            models = protocol.next_models(models, rng)
        updates = [client_update(m, b, cfg, d, i) for i, (m, b, d) in enumerate(zip(models, batches, defenses))]
        observed = send_round(defenses, updates, rng)
        held = observer_model(attack, protocol.observer_model(model, models), cfg)
        seen.append(Observation(observed, knowledge, held))
    observation = dataclasses.replace(seen[-1], rounds=(*history, *seen[:-1]))
    rec = attack.reconstruct(observation, generator(cfg.seed, "attack"))
    if rec.x is not None and not torch.isfinite(rec.x).all():  # say so, rather than fail later in the matching
        raise FloatingPointError("the reconstruction has NaN or infinite pixels")

    rec_images = denormalize(rec.x.detach(), ds.mean, ds.std) if rec.x is not None else None
    blind = mean_image(pool.x)  # the blind guess: the mean image of the split the victims come from
    scores = score(victim.images(), victim.y, rec_images, rec.y, lpips_weights, blind)
    # The distance is to the plain update, so that a defense acting inside the client's computation (DP-SGD) counts.
    plain = updates[0] if type(protocol).client_gradient is Defense.client_gradient else client_update(models[0], victim, cfg)
    scores["grad_dist"] = relative_distance(plain.flat(), observed.flat())
    share = scores.pop("share_psnr40")  # a diagnostic beside the attack's own (images only)
    extra = {**model_info, **rec.extra} if share is None else {"share_psnr40": share, **model_info, **rec.extra}
    extra.update(scores.pop("blind"))
    scores["extra"] = {k: _finite_or_none(v) for k, v in extra.items()}
    scores["_images"] = (victim.images(), rec_images)
    scores["_arrays"] = (victim.images(), victim.y, rec_images, rec.y, blind)
    return scores


def run_trial(cfg: TrialConfig, lpips_weights: str | None = None, image_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one trial and return its row for the store. Never raises for a failing trial: the row says why."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"trial_id": cfg.trial_id, "config": cfg.to_json(), "status": "ok", "error": None}
    try:
        with torch.random.fork_rng(devices=[]):  # a plugin that touches the global RNG cannot leak into the next trial
            torch.manual_seed(derive_seed(cfg.seed, "global"))
            scores = execute(cfg, lpips_weights)
        truth, rec = scores.pop("_images")
        arrays = scores.pop("_arrays")
        if arrays[2] is not None:  # kept as arrays, so that `gleak rescore` recomputes metrics without the attack
            from gleak.reconstructions import pack

            row["reconstruction"] = pack(*arrays)
        if image_dir is not None and rec is not None:
            from gleak.figures import save_reconstruction

            path = Path(image_dir) / f"{cfg.trial_id}.png"
            save_reconstruction(truth, rec, path)
            scores["image"] = str(path.name)
        for k in ("psnr", "mse", "ssim", "lpips", "cosine", "grad_dist"):
            v = scores.get(k)
            if isinstance(v, float) and math.isnan(v):
                raise FloatingPointError(f"metric {k} is NaN")
        row.update(scores)
    except Exception as exc:  # noqa: BLE001 - a failing trial is data, not a crash
        row.update(status="failed", error=_one_line(exc), traceback=traceback.format_exc(limit=8))
    row["extra"] = json.dumps(row.get("extra") or {}, sort_keys=True)
    row["seconds"] = time.perf_counter() - t0
    return row
