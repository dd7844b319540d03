"""The modality of a case, chosen by its data set: the one place where images and text differ in a trial.

Everything between the batches and the reconstruction (protocol rounds, defenses on the update dict, the gate, the
attack's interface) is the same for both. What differs is here: how a case's data set is loaded, which models fit
it, what a reconstruction must look like, how it is scored against the truth and the blind guess, and what is
kept of it (images: arrays and a PNG; text: the reconstructed tokens beside the truth in the row's extra).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from gleak.contracts.attack_output import check_reconstruction, max_images
from gleak.contracts.plugin import hard_labels
from gleak.contracts.vocabulary import DEFAULT_SEQ_LEN, DEFAULT_VOCAB_SIZE, is_text_dataset
from gleak.contracts.wire import denormalize, normalize
from gleak.mechanics.data import load_dataset
from gleak.mechanics.metrics import mean_image, original_scores, score, victim_share

TEXT_MODELS = ("text-classifier", "text-lm")
LANGUAGE_MODELS = ("text-lm",)  # trained on next-token targets (gleak.mechanics.text.data)


@dataclass(frozen=True)
class Finished:
    """A scored trial: the row's metric columns with their extra, the images to keep (truth, reconstruction) and
    the arrays for `gleak rescore` (None where the modality keeps none)."""

    scores: dict[str, Any]
    images: tuple[Any, Any]
    arrays: tuple[Any, ...] | None


def model_features(model: torch.nn.Module, mean: torch.Tensor, std: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """images in [0, 1] -> the model's output on them (normalised with the clients' `mean` and `std`, in the model's
    dtype and on its device; back on the CPU). Evaluation mode (batch norm at its running statistics, so that an
    image's output does not depend on the batch it is scored with), the model's mode restored after."""
    p = next(model.parameters(), None)
    device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)

    def features(images: torch.Tensor) -> torch.Tensor:
        was = model.training
        model.eval()
        try:
            out = model(normalize(images, mean, std).to(device=device, dtype=dtype))
        finally:
            model.train(was)
        return out.detach().cpu()

    return features


class ImageModality:
    name = "image"

    def load(self, case: Any, split: str):
        return load_dataset(case.dataset, split, root=case.data_root, resolution=case.resolution,
                            channels=case.channels, download=case.download)  # fmt: skip

    def case_problems(self, case: Any) -> list[tuple[str, str]]:
        """(key, problem) of a case (or a [utility] table) that does not fit images."""
        out = [(k, f"applies to text data sets only (dataset {case.dataset!r} is images)")
               for k in ("seq_len", "vocab_size") if getattr(case, k) is not None]  # fmt: skip
        if case.model in TEXT_MODELS:
            out.append(("model", f"{case.model!r} is a text model; dataset {case.dataset!r} is images"))
        return out

    def finish(self, cfg: Any, ds: Any, pool: Any, observed: list, sent: Any, rec: Any, extra_model: dict, eps: Any,
               lpips_weights: str | None, model: torch.nn.Module | None = None,
               scored_against: str = "sent") -> Finished:  # fmt: skip
        """Check the reconstruction, score it against what was sent and the mean image of the victims' split.
        `model`: the model the victim computed its observed update at (feature-space MSE; None: not scored).
        `sent`: the victim's batch as its transforming defense sent it (None: as it is); `scored_against` "private"
        (the defense's declaration, Defense.scored_against) makes the victim's own batch the truth and scores what
        was sent beside it (extra *_sent), "sent" the reverse (extra *_original).
        `observed`: the batches of the clients whose samples the observed update carries, the victim's first: the
        attack may return one row per sample among them; where there are several, its rows are paired one-to-one
        with all of them, the victim scored on the rows paired with its own, and the share of every observed
        sample recovered kept beside it (extra.observed_share_psnr40)."""
        victim = observed[0]
        limit = max_images(sum(b.size for b in observed), 1)
        check_reconstruction(rec, ds.input_shape, ds.num_classes, limit, cfg.attack)  # before anything reads it
        rec_x = rec.x.detach().cpu() if rec.x is not None else None
        rec_y = rec.y.cpu() if isinstance(rec.y, torch.Tensor) else rec.y
        if rec_x is not None and not torch.isfinite(rec_x).all():  # say so, rather than fail later in the matching
            raise FloatingPointError("the reconstruction has NaN or infinite pixels")
        rec_images = denormalize(rec_x, ds.mean, ds.std) if rec_x is not None else None
        blind = mean_image(pool.x)  # the blind guess: the mean image of the split the victims come from
        # The truth is what was sent: the batch that entered the victim's gradient (a transforming defense's output),
        # unless the defense declares its encodings are not yet anyone's image (MixUp): then the victim's own batch.
        private = sent is not None and scored_against == "private"
        truth = victim if private or sent is None else sent
        everyone = None  # the share of every observed sample recovered, where the update carries several clients'
        if len(observed) > 1 and rec_images is not None:
            rows, everyone = victim_share([truth.images()] + [b.images() for b in observed[1:]], rec_images)
            if rec_y is not None and len(rec_y) == len(rec_images):  # labels row by row: the same rows
                rec_y = rec_y[rows]
            rec_images = rec_images[rows]
        original = None if sent is None or private else victim.images()
        scores = score(truth.images(), truth.y, rec_images, rec_y, lpips_weights, blind, cfg.verdict,
                       search=(pool.x, pool.y), targets=original,  # identified among the split's images (iip)
                       features=None if model is None else model_features(model, ds.mean, ds.std))  # fmt: skip
        share = scores.pop("share_psnr40")  # a diagnostic beside the attack's own (images only)
        extra = {**extra_model, **rec.extra} if share is None else {"share_psnr40": share, **extra_model, **rec.extra}
        if everyone is not None:
            extra["observed_share_psnr40"] = everyone
            extra["observed_samples"] = sum(b.size for b in observed)
        if original is not None:  # a separate question: how close the reconstruction comes to the untransformed images
            extra.update(original_scores(original, victim.y, rec_images, rec_y, lpips_weights, blind, cfg.verdict))
        if private:  # and the reverse: how close it comes to the encodings that were sent
            extra.update(original_scores(sent.images(), hard_labels(sent.y), rec_images, rec_y, lpips_weights, blind,
                                         cfg.verdict, suffix="sent"))  # fmt: skip
        if eps is not None:
            extra["epsilon"] = eps
        extra.update(scores.pop("blind"))
        if scores["verdict"] is not None:
            extra["verdict_rule"] = cfg.verdict  # the rule of the stored verdict (gleak.mechanics.verdicts.trial_verdict)
        scores["extra"] = extra
        return Finished(scores, (truth.images(), rec_images), (truth.images(), truth.y, rec_images, rec_y, blind, original))


class TextModality:
    """Token-id batches (B, L); reconstructions (n, L, V) scores over the vocabulary (gleak.mechanics.text.metrics)."""

    name = "text"

    def load(self, case: Any, split: str):
        from gleak.mechanics.text.data import load_text_dataset

        return load_text_dataset(case.dataset, split, root=case.data_root, seq_len=case.seq_len or DEFAULT_SEQ_LEN,
                                 vocab_size=case.vocab_size or DEFAULT_VOCAB_SIZE,
                                 targets="next" if case.model in LANGUAGE_MODELS else "class")  # fmt: skip

    def case_problems(self, case: Any) -> list[tuple[str, str]]:
        """(key, problem) of a case (or a [utility] table) that does not fit text."""
        out = [(k, f"applies to image data sets only (dataset {case.dataset!r} is text)")
               for k in ("resolution", "channels") if getattr(case, k) is not None]  # fmt: skip
        if case.model not in TEXT_MODELS:
            out.append(("model", f"dataset {case.dataset!r} is text: the model must be one of {', '.join(TEXT_MODELS)}, "
                                 f"got {case.model!r}"))  # fmt: skip
        if case.seq_len is not None and not 2 <= case.seq_len <= 512:
            out.append(("seq_len", f"must be in [2, 512], got {case.seq_len}"))
        if case.vocab_size is not None and not 3 <= case.vocab_size <= 100_000:
            out.append(("vocab_size", f"must be in [3, 100_000], got {case.vocab_size}"))
        if getattr(case, "distinct_labels", False) and case.model in LANGUAGE_MODELS:
            out.append(("distinct_labels", "a language model's labels are its next tokens: no classes to keep distinct"))
        return out

    def finish(self, cfg: Any, ds: Any, pool: Any, observed: list, sent: Any, rec: Any, extra_model: dict, eps: Any,
               lpips_weights: str | None, model: torch.nn.Module | None = None,
               scored_against: str = "sent") -> Finished:  # fmt: skip
        """Check the reconstruction's shape, score it (ROUGE, token accuracy, token set) against the victim's
        sequences (observed[0]; a text case has one client) and the blind guess; the truth and the reconstruction's
        first sequence go to the row's extra."""
        from gleak.mechanics.text.data import frequent_tokens
        from gleak.mechanics.text.metrics import text_scores
        from gleak.mechanics.verdicts import TEXT_VERDICT_RULE

        victim = observed[0]
        limit = max_images(sum(b.size for b in observed), 1)
        check_reconstruction(rec, ds.input_shape, 1 << 62, limit, cfg.attack)  # labels are not scored for text
        rec_x = rec.x.detach().cpu() if rec.x is not None else None
        if rec_x is not None and not torch.isfinite(rec_x).all():
            raise FloatingPointError("the reconstruction has NaN or infinite scores")
        truth = victim.x.cpu()
        blind = frequent_tokens(ds, ds.seq_len)  # the training split's most frequent tokens (ds: the train split)
        s = text_scores(truth, rec_x, blind, ds.vocab)
        scores: dict[str, Any] = dict(mse=None, psnr=None, ssim=None, lpips=None, cosine=None, label_acc=None,
                                      verdict=s.pop("verdict"), matched=s.pop("matched"))  # fmt: skip
        text = s.pop("text", None)
        extra = {**extra_model, **rec.extra, "modality": "text", **s}
        extra["text_truth"] = " ".join(ds.tokens(truth[:1])[0])
        if text is not None:
            extra["text_reconstruction"] = text
        if eps is not None:
            extra["epsilon"] = eps
        if scores["verdict"] is not None:
            extra["verdict_rule"] = TEXT_VERDICT_RULE
        scores["extra"] = extra
        return Finished(scores, (None, None), None)


IMAGE, TEXT = ImageModality(), TextModality()


def victims_split(case: Any) -> str:
    """The split the clients' batches come from. A trained model is attacked on images it never trained on
    (Geiping et al. attack validation images): the test split, and public data for the attacker from the training
    split; an untrained model, the training split."""
    return "test" if case.model_state == "trained" else "train"


def modality_of(case: Any) -> ImageModality | TextModality:
    """The modality of a case (a gleak.contracts.config.CaseConfig), chosen by its data set's name."""
    return TEXT if is_text_dataset(case.dataset) else IMAGE
