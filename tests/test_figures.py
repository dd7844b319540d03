"""The suite-level figures render their math (log axes' ticks), keep data text literal, and never overlap or clip
their labels."""
from __future__ import annotations

import io
import itertools
import re

import numpy as np
import pandas as pd
import pytest

from gleak.reporting import figures


def _lines(xs: list[float], attacks=("closed-form", "idlg")) -> pd.DataFrame:
    rows = []
    for a, x in itertools.product(attacks, xs):
        rows.append({"attack": a, "group": "", "x": x, "psnr": 40 - 100 * x, "ssim": 0.9 - x / 2, "mse_median": 1e-4 + x,
                     "lpips": None, "label_acc": 1.0, "psnr_err": 1.0, "ssim_err": 0.05, "lpips_err": None,
                     "label_acc_err": 0.0})  # fmt: skip
    return pd.DataFrame(rows)


@pytest.fixture()
def drawn(monkeypatch):
    """The figures that save_figure wrote during the test (it still writes them)."""
    caught = []
    save = figures.save_figure

    def keep(fig, path):
        caught.append(fig)
        return save(fig, path)

    monkeypatch.setattr(figures, "save_figure", keep)
    return caught


def _svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as <text> elements, so the test can read it
        fig.savefig(buf, format="svg")
    return re.sub(r"<!--.*?-->", "", buf.getvalue(), flags=re.S)  # the drawn text, not the source in comments


def test_log_axes_render_their_ticks_as_math(tmp_path, drawn):
    """A noise strength figure (log x, log MSE): the rendered tick labels are powers of ten, not the formatter's
    literal '$\\mathdefault{10^{-1}}$' (which matplotlib draws as written when math text is off)."""
    lines = _lines([1e-3, 1e-2, 1e-1])
    path = figures.strength_figure(lines, None, {"psnr": {"closed-form": 70.0}}, "sigma", tmp_path / "s.png", "noise")
    assert path.is_file()
    svg = _svg(drawn[0])
    assert "mathdefault" not in svg and "10^{" not in svg
    assert "\u2212" in svg  # the rendered minus sign of 10^-1, which only math text draws
    fig = drawn[0]
    r = _renderer(fig)
    logged = [ax for ax in fig.axes if ax.get_xscale() == "log"]
    assert logged
    for ax in logged:  # each label drawn as math: narrower than its literal text would be
        for t in ax.get_xticklabels():
            if "mathdefault" in t.get_text() and t.get_visible():
                assert t._preprocess_math(t.get_text())[1], t.get_text()
                assert t.get_window_extent(r).width < 40, (t.get_text(), t.get_window_extent(r).width)


def _renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    return fig.canvas.get_renderer()


def _overlaps(boxes) -> list[tuple[int, int]]:
    out = []
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        if a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1:
            out.append((i, j))
    return out


@pytest.mark.parametrize("xs", [[1e-4, 1e-3, 1e-2, 1e-1, 1.0], [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999]])
def test_tick_labels_never_overlap(tmp_path, drawn, xs):
    """Rendered x tick labels of every panel (log noise scales; a logit axis of close pruning ratios, ticked at the
    values) have disjoint bounding boxes."""
    figures.strength_figure(_lines(xs), None, {}, "ratio", tmp_path / "s.png", "topk")
    fig = drawn[0]
    r = _renderer(fig)
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim())
        boxes = [t.get_window_extent(r) for t in ax.get_xticklabels()
                 if t.get_visible() and t.get_text() and lo <= t.get_position()[0] <= hi]  # fmt: skip
        assert len(boxes) >= 2
        assert not _overlaps(boxes), [t.get_text() for t in ax.get_xticklabels()]


def test_a_legend_wider_than_the_panels_is_saved_whole(tmp_path, drawn):
    """One panel (PSNR only) and an attack label longer than the figure is wide: the saved image holds all of it."""
    from PIL import Image

    long = "inverting-gradients " + ", ".join(f"parameter_{i}={i / 7:.4f}" for i in range(8))
    lines = _lines([0.5, 0.9, 0.99], ("closed-form", long)).drop(columns=["ssim", "mse_median", "label_acc"])
    path = figures.strength_figure(lines, None, {}, "ratio", tmp_path / "s.png", "topk")
    fig = drawn[0]
    box, saved = fig.get_tightbbox(_renderer(fig)), Image.open(path)
    assert box.width > fig.get_figwidth()  # the case this test is about: wider than the figure laid out
    assert box.width * fig.dpi <= saved.width + 2 and box.height * fig.dpi <= saved.height + 2


def test_dollars_in_data_are_text_and_titles_are_not_clipped(tmp_path, drawn):
    """A '$' in an attack's label is drawn as a dollar (it would be bad math text otherwise), and a reconstruction
    grid of four attacks with long names keeps its title and column heads inside the saved image."""
    from PIL import Image

    img_dir = tmp_path / "images"
    img_dir.mkdir()
    Image.fromarray(np.full((200, 100, 3), 128, np.uint8)).save(img_dir / "a.png")
    cols = ["dlg iterations=300, labels=soft, restarts=16", "dlg iterations=300, labels=idlg, restarts=16",
            "inverting-gradients iterations=1200, tv=0.01, note=$\\frac{$",
            "mine state=/data/checkpoints/my_model_trained_for_a_long_time.pt"]  # a word wider than its column
    cells = pd.DataFrame({"row_label": ["none"] * 4, "col_label": cols, "image": ["a.png"] * 4, "psnr": [4.8, 27.4, 21.0, 9.0]})
    title = "Reconstructions, skimage/lenet/B=1 (model_state=trained), seed 0"
    path = figures.reconstruction_grid(cells, img_dir, tmp_path / "g.png", title)
    fig = drawn[0]
    svg = _svg(fig)
    assert "$\\frac{$" in svg.replace("&#36;", "$")
    saved = Image.open(path)
    r = _renderer(fig)
    box = fig.get_tightbbox(r)  # inches, from the figure's lower left: every text drawn, wherever it lies
    inside = fig.bbox_inches if saved.size == (round(fig.bbox.width), round(fig.bbox.height)) else None
    if inside is not None:  # saved at the figure's own size: then nothing may stick out of it
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= inside.x1 and box.y1 <= inside.y1, (box, inside)
    assert box.width * fig.dpi <= saved.width + 2 and box.height * fig.dpi <= saved.height + 2
    from matplotlib.text import Annotation

    heads = fig.findobj(Annotation)  # the column heads
    assert len(heads) == 4
    assert not _overlaps([t.get_window_extent(r) for t in heads])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reconstruction_sits_under_its_own_image_and_a_missing_one_is_a_grey_cell(seed):
    """The attack returns two rows for a batch of four: the true batch keeps its order, each row is drawn under
    the image it is paired with, and the two images without one have a grey cell under them."""
    import torch

    from gleak.orchestration.images import MISSING_GREY, reconstruction_image

    g = torch.Generator().manual_seed(seed)
    truth = torch.rand(4, 3, 8, 8, generator=g)
    picked = torch.randperm(4, generator=g)[:2]
    png = reconstruction_image(truth, truth[picked].flip(0))
    scale, pad, side = 96 // 8, 2, 96
    cell = lambda row, col: png[pad + row * (side + pad): pad + row * (side + pad) + side,  # noqa: E731
                                pad + col * (side + pad): pad + col * (side + pad) + side]  # fmt: skip
    for col in range(4):
        above = cell(0, col)
        expect = (truth[col].permute(1, 2, 0).repeat_interleave(scale, 0).repeat_interleave(scale, 1) * 255).round()
        assert (above == expect.numpy()).all()  # the true batch in its own order
        below = cell(1, col)
        if col in picked.tolist():
            assert (below == above).all()
        else:
            assert (below == round(MISSING_GREY * 255)).all()


@pytest.mark.parametrize("batch", [8, 16, 40])
def test_a_grid_shows_the_first_sixteen_images_of_a_large_batch_and_says_so(tmp_path, drawn, batch):
    """A batch of 40 stored whole is cut to its first 16 columns (truth and reconstruction alike), the head says how
    many of how many; a batch of 16 or fewer is drawn whole."""
    import torch
    from PIL import Image

    from gleak.orchestration.images import first_images, reconstruction_image

    truth = torch.rand(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))
    png = reconstruction_image(truth, truth)
    shown, n = first_images(png, 16)
    assert n == batch
    assert shown.shape[0] == png.shape[0] and shown.shape[1] == 2 + min(batch, 16) * (96 + 2)
    assert (shown == png[:, : shown.shape[1]]).all()  # the first columns, cut at an image's edge
    img_dir = tmp_path / "images"
    img_dir.mkdir()
    Image.fromarray(png).save(img_dir / "a.png")
    cells = pd.DataFrame({"row_label": ["none"], "col_label": ["closed-form"], "image": ["a.png"], "psnr": [120.0]})
    figures.reconstruction_grid(cells, img_dir, tmp_path / "g.png", "Reconstructions")
    head = drawn[0]._suptitle.get_text()
    assert ("the first 16 of 40 shown" in head) == (batch == 40), head


def test_a_strength_line_varies_one_parameter_and_holds_every_other_fixed():
    """A defense run at delta 0.01 and 0.1 (1 iteration) and at 4 iterations (delta 0.1), and MixUp at k = 4 and at
    k = 6 with pruning: the delta line holds iterations at 1, the iterations line holds delta at 0.1, and MixUp has no
    strength axis (k and prune change together), never a line through two settings of another parameter."""
    import json

    from gleak.reporting.aggregate import strength_series

    def js(**p):
        return json.dumps(p, sort_keys=True)

    configs = [("cgd", js(delta=0.01, iterations=1, mode="a")), ("cgd", js(delta=0.1, iterations=1, mode="a")),
               ("cgd", js(delta=0.1, iterations=4, mode="a")), ("cgd", js(delta=0.01, iterations=1, mode="b")),
               ("cgd", js(delta=0.1, iterations=1, mode="b")),
               ("mixup", js(k=4)), ("mixup", js(k=6, prune=0.9))]  # fmt: skip
    agg = pd.DataFrame([{"defense": d, "defense_params": p} for d, p in configs])
    got = {(name, key): {label: sorted(xs.values()) for label, xs in lines}
           for name, key, lines in strength_series(agg, {"cgd": {"delta", "iterations", "mode"}, "mixup": {"k", "prune"}})}
    assert got == {("cgd", "delta"): {"mode=a": [0.01, 0.1], "mode=b": [0.01, 0.1]},
                   ("cgd", "iterations"): {"": [1.0, 4.0]}}  # fmt: skip


def _setting_rows():
    """Two attacks at batch 1, 4 and 16 on an untrained and a trained model, 4 seeds each; a defended copy (noise)
    and a secure sum of 2 and 4 clients. The attack 'a' recovers the untrained model's batches up to 4 (seeds 0-1
    also at 16), the trained model's only at batch 1."""
    import json

    rows = []

    def case(**kw):
        base = {"batch_size": 1, "clients": 1, "dataset": "skimage", "model": "mlp", "model_state": "untrained",
                "protocol": "fedsgd", "protocol_params": {}}  # fmt: skip
        return json.dumps({**base, **kw}, sort_keys=True)

    for attack, state, b, seed in itertools.product("ab", ("untrained", "trained"), (1, 4, 16), range(4)):
        rec = attack == "a" and (b == 1 or (state == "untrained" and (b == 4 or seed < 2)))
        rows.append({"attack": attack, "attack_params": "{}", "defense": "none", "defense_params": "{}",
                     "status": "ok", "psnr": 80.0 if rec else 12.0, "verdict": "recovered" if rec else "defended",
                     "case": case(batch_size=b, model_state=state)})  # fmt: skip
        rows.append({**rows[-1], "defense": "noise", "defense_params": '{"sigma": 0.1}', "psnr": 10.0,
                     "verdict": "defended"})  # fmt: skip
    for clients, seed in itertools.product((2, 4), range(4)):
        rows.append({"attack": "a", "attack_params": "{}", "defense": "secure-aggregation", "defense_params": "{}",
                     "status": "ok", "psnr": 70.0 if clients == 2 else 11.0,
                     "verdict": "recovered" if clients == 2 else "defended",
                     "case": case(batch_size=4, clients=clients, protocol="secure-aggregation")})  # fmt: skip
    return pd.DataFrame(rows)


def test_what_leaks_against_a_setting_holds_every_other_setting_fixed_and_leaves_defenses_out(tmp_path):
    from gleak.reporting.setting_figure import setting_figure, setting_series

    series = dict(setting_series(_setting_rows(), {}, {}))
    assert set(series) == {"batch_size", "clients"}
    lines = series["batch_size"]
    # one line per attack and model state; the noise-defended copies drawn nowhere
    assert sorted(set(lines["label"])) == ["a, model_state=trained", "a, model_state=untrained",
                                           "b, model_state=trained", "b, model_state=untrained"]  # fmt: skip
    share = {(r.label, r.x): r.recovered for r in lines.itertuples()}
    assert share[("a, model_state=untrained", 4.0)] == 1.0 and share[("a, model_state=untrained", 16.0)] == 0.5
    assert share[("a, model_state=trained", 1.0)] == 1.0 and share[("a, model_state=trained", 4.0)] == 0.0
    assert all(v == 0.0 for (label, _), v in share.items() if label.startswith("b"))
    assert lines["n"].eq(4).all()
    assert (lines["psnr"] > 11).all()  # no defended trial's 10 dB in a median
    clients = series["clients"]
    assert list(clients["recovered"]) == [1.0, 0.0] and list(clients["x"]) == [2.0, 4.0]
    assert setting_figure(lines, "batch_size", tmp_path / "s.png", "What leaks").stat().st_size > 0


def test_two_cases_that_differ_past_the_file_name_cut_keep_two_figures():
    from gleak.reporting.report import _slug

    head = "fashion-mnist_mlp_8_model_params={'hidden': [64]}, protocol_params={'local_batch_size': 8, "
    a, b = _slug(head + "'local_steps': 2}"), _slug(head + "'local_steps': 5}")
    assert a != b and len(a) == len(b) == 80
    assert _slug("skimage_mlp_16") == "skimage_mlp_16"  # a short one as it was
