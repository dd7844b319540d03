"""Figures: per-trial reconstruction grids (PIL, cheap enough to write from every trial) and the suite-level plots
(matplotlib) that `gleak plot DIR` and `gleak run` write to DIR/figures/: reconstruction grids per attack x defense,
each metric against defense strength, the privacy-utility frontier, and the utility runs' learning curves."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np

from gleak.contracts.escaping import strip_controls

# Their home before gleak.mechanics.atomic_files and gleak.orchestration.images (the trial writes reconstructions without the plotting code).
from gleak.mechanics.atomic_files import atomic_write_bytes  # noqa: F401
from gleak.orchestration.images import image_grid, save_reconstruction  # noqa: F401

# ---- suite-level figures (matplotlib, Agg, no pyplot state) ----------------------------------------------------
# The report (gleak.reporting.report) prepares the frames and the labels; these functions only draw and write PNGs.
ATTACK_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P"]
# PSNR (dB) of the verdict bands' MSE thresholds: 10 log10(1 / MSE).
RECOVERED_PSNR = 10 * math.log10(1 / 0.03)
PARTIAL_PSNR = 10 * math.log10(1 / 0.2)


def plain_text(fn):
    """Decorator of every function that draws a figure: TeX off whatever the user's matplotlibrc says, math text on
    (the log axes' tick labels are math: '$\\mathdefault{10^{-1}}$'). Text that comes from data (a plugin's
    parameter, a data path) is escaped before drawing (`escape_dollars`), so a '$' in it is a dollar, never math."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": True, "text.usetex": False}):
            return fn(*args, **kwargs)

    return wrapper


_DOLLAR = re.compile(r"(?<!\\)\$")


def escape_dollars(fig) -> None:
    """Every '$' of the figure's texts but the tick labels (which the axes' formatters write as math on purpose)
    escaped, so that matplotlib draws it as a dollar sign: text from data is never read as math."""
    from matplotlib.text import Text

    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in axis.get_major_ticks() + axis.get_minor_ticks() for t in (tick.label1, tick.label2)}  # fmt: skip
    for t in fig.findobj(Text):
        if id(t) not in ticks and "$" in t.get_text():
            t.set_text(_DOLLAR.sub(r"\\$", t.get_text()))


def thin_tick_labels(fig, pad: float = 3.0) -> None:
    """Drop x tick labels that would overlap their left neighbour (a logit axis of close pruning ratios), keeping the
    first: the axis gets the kept ticks as fixed ones, so that the next draw keeps them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)  # the PNG's renderer: the sizes measured are the sizes drawn
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim())
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text() and lo <= t.get_position()[0] <= hi]
        kept, right = [], -math.inf
        for t in sorted(labels, key=lambda t: t.get_window_extent(renderer).x0):
            box = t.get_window_extent(renderer)
            if box.x0 >= right + pad:
                kept.append(t)
                right = box.x1
        if len(kept) < len(labels):
            ax.set_xticks([t.get_position()[0] for t in kept], [t.get_text() for t in kept])


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def save_figure(fig, path: Path) -> Path:
    """The figure as a PNG at `path` (atomically), its bounding box grown to hold every text (nothing clipped)."""
    import io

    escape_dollars(fig)
    thin_tick_labels(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight", pad_inches=0.08)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


# Above this PSNR a reconstruction is visually exact (MSE 1e-6); higher values (float64 round-off, inf) would squash
# every other point, so figures draw them at the cap with an upward triangle.
PSNR_CAP = 60.0
MSE_FLOOR = 10 ** (-PSNR_CAP / 10)


def _clip(values: list[float | None], key: str) -> tuple[list[float | None], list[bool]]:
    """PSNR above PSNR_CAP (and MSE below MSE_FLOOR) drawn at the cap; the flags say which were clipped."""
    out, flags = [], []
    for v in values:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append(None)
            flags.append(False)
        elif key == "psnr" and v > PSNR_CAP:
            out.append(PSNR_CAP)
            flags.append(True)
        elif key == "mse_median" and v < MSE_FLOOR:
            out.append(MSE_FLOOR)
            flags.append(True)
        else:
            out.append(float(v))
            flags.append(False)
    return out, flags


def _band_axis(ax) -> None:
    """Right-hand axis that names the verdict bands on a PSNR axis (constrained layout makes room for it)."""
    lo, hi = ax.get_ylim()
    ax.axhspan(RECOVERED_PSNR, max(hi, RECOVERED_PSNR), color="#d62728", alpha=0.06, linewidth=0)
    ax.axhspan(PARTIAL_PSNR, RECOVERED_PSNR, color="#ff7f0e", alpha=0.06, linewidth=0)
    ax.set_ylim(lo, hi)
    right = ax.twinx()
    right.set_ylim(lo, hi)
    ticks = [(t, l) for t, l in ((RECOVERED_PSNR, "recovered\n(MSE < 0.03) ↑"), (PARTIAL_PSNR, "partial\n(MSE < 0.2) ↑")) if lo <= t <= hi]
    right.set_yticks([t for t, _ in ticks], [l for _, l in ticks], fontsize=7)
    right.tick_params(length=0)
    for t, _ in ticks:
        ax.axhline(t, color="#999999", linewidth=0.6, linestyle="--")


def _psnr_text(p) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return ""
    return "PSNR inf (exact)" if math.isinf(p) else f"PSNR {p:.1f} dB"


def _image_panel(ax, entry) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    for s in ax.spines.values():
        s.set_visible(False)
    if entry is None:
        ax.text(0.5, 0.5, "no image", ha="center", va="center", fontsize=8, color="#888", transform=ax.transAxes)
    else:
        ax.imshow(entry[0], interpolation="nearest")


def _wrap(text: str, width: int) -> str:
    import textwrap

    return textwrap.fill(text, width, break_on_hyphens=False)


# A stored reconstruction PNG is a batch's truth above its reconstruction: far below this many pixels. A larger one
# (a decompression bomb placed in images/) is skipped, named, before it is decoded.
MAX_STORED_PIXELS = 1 << 24


def _stored_images(cells, image_dir: Path, from_store=None) -> dict:
    """(row_label, col_label) -> (the trial's stored PNG as an RGB array, its PSNR), for the images that exist and
    decode as PNGs of at most MAX_STORED_PIXELS pixels; any other is skipped with one line on stderr naming it.
    from_store(trial_ids) -> {trial_id: RGB array}: the same pixels drawn from the store's arrays, for the trials
    whose PNG is not a plain file in `image_dir` (images/ gone, or a link there)."""
    from PIL import Image

    images, lost = {}, []
    for _, c in cells.iterrows():
        f = image_dir / str(c["image"])
        if not f.is_file() or f.is_symlink() or image_dir.is_symlink():
            lost.append(c)
            continue
        try:
            with Image.open(f) as im:
                if im.format != "PNG" or im.size[0] * im.size[1] > MAX_STORED_PIXELS:
                    raise ValueError(f"{im.format} of {im.size[0]} x {im.size[1]} pixels, not a stored reconstruction")
                images[(c["row_label"], c["col_label"])] = (np.asarray(im.convert("RGB")), c["psnr"])
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            print(f"gleak: {f}: skipped ({strip_controls(str(exc)).splitlines()[0] if str(exc) else type(exc).__name__})",
                  file=sys.stderr)  # fmt: skip
    if lost and from_store is not None and "trial_id" in cells:
        drawn = from_store([c["trial_id"] for c in lost])
        for c in lost:
            if c["trial_id"] in drawn:
                images[(c["row_label"], c["col_label"])] = (drawn[c["trial_id"]], c["psnr"])
    return images


def _wrapped_grid(rows: list[str], col: str, images: dict, cell_w: float, img_h: float, extra_top: float = 0.0):
    """One attack: a wrapped grid of defenses, each panel titled with its configuration and PSNR; `extra_top`
    inches more above the panels for a title of more than two lines."""
    from matplotlib.figure import Figure

    n = len(rows)
    ncols = min(n, max(1, round(math.sqrt(n * 1.6 * img_h / cell_w))))
    nrows = math.ceil(n / ncols)
    titles = [_wrap(r, 26) for r in rows]
    title_h = 0.16 * max(t.count("\n") + 2 for t in titles)
    fig = Figure(figsize=(0.3 + ncols * (cell_w + 0.25), 0.9 + extra_top + nrows * (img_h + title_h + 0.15)), dpi=100)
    fig.subplots_adjust(left=0.15 / fig.get_figwidth(), right=1 - 0.15 / fig.get_figwidth(),
                        top=1 - (0.75 + extra_top + title_h) / fig.get_figheight(), bottom=0.1 / fig.get_figheight(),
                        hspace=(title_h + 0.15) / img_h, wspace=0.25 / cell_w)  # fmt: skip
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, r, t in zip(axes, rows, titles):
        entry = images.get((r, col))
        _image_panel(ax, entry)
        ax.set_title(f"{t}\n{_psnr_text(entry[1]) if entry else ''}", fontsize=7.5, pad=3)
    for ax in axes[n:]:
        ax.axis("off")
    return fig


def _table_grid(rows: list[str], cols: list[str], images: dict, cell_w: float, img_h: float, extra_top: float = 0.0):
    """Rows: defenses, columns: attacks; the column heads wrapped to the cell's width (about 12 bold characters per
    inch at 9 pt; at hyphens, or inside a word longer than that), the row labels on the left."""
    import textwrap

    from matplotlib.figure import Figure

    wrap = {r: _wrap(r, 24) for r in rows}
    heads = {c: textwrap.fill(c, max(8, int(cell_w * 12))) for c in cols}
    head_h = 0.15 * (max(h.count("\n") for h in heads.values()))
    label_w = 0.3 + 0.075 * max(len(line) for r in rows for line in wrap[r].splitlines())
    cell_h = img_h + 0.3
    fig = Figure(figsize=(label_w + cell_w * len(cols) + 0.2, 0.9 + extra_top + head_h + cell_h * len(rows)), dpi=100)
    fig.subplots_adjust(left=label_w / fig.get_figwidth(), right=1 - 0.2 / fig.get_figwidth(),
                        top=1 - (0.8 + extra_top + head_h) / fig.get_figheight(), bottom=0.1 / fig.get_figheight(),
                        hspace=0.36 / cell_h, wspace=0.08)  # fmt: skip
    axes = fig.subplots(len(rows), len(cols), squeeze=False)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax, entry = axes[i][j], images.get((r, c))
            _image_panel(ax, entry)
            ax.set_title(_psnr_text(entry[1]) if entry else "", fontsize=8, pad=2)
            if i == 0:
                ax.annotate(heads[c], (0.5, 1.0), xytext=(0, 14), xycoords="axes fraction", textcoords="offset points",
                            ha="center", va="bottom", fontsize=9, fontweight="bold")  # fmt: skip
            if j == 0:
                ax.set_ylabel(wrap[r], rotation=0, ha="right", va="center", fontsize=8, labelpad=6)
    return fig


MAX_SHOWN = 16  # images of a batch a reconstruction grid shows (the first ones, in the stored PNG's order)


@plain_text
def reconstruction_grid(cells, image_dir: Path, path: Path, title: str, from_store=None) -> Path | None:
    """The trials' stored PNGs (truth above the reconstruction) with their PSNR, per defense configuration (rows) and
    attack (columns). With a single attack the defenses wrap into several columns instead of one tall strip.
    `cells`: DataFrame with row_label, col_label, image, psnr, in display order."""
    rows = list(dict.fromkeys(cells["row_label"]))
    cols = list(dict.fromkeys(cells["col_label"]))
    images = _stored_images(cells, image_dir, from_store)
    if not images:
        return None
    from gleak.orchestration.images import first_images

    counts = {}
    for key, (pixels, psnr) in images.items():
        shown, counts[key] = first_images(pixels, MAX_SHOWN)
        images[key] = (shown, psnr)
    h, w = next(iter(images.values()))[0].shape[:2]
    cell_w = max(1.5, min(3.0, 1.1 * w / 100))  # the stored PNGs are drawn at about 100 px per inch
    img_h = cell_w * h / w
    head = "each panel: true batch above, reconstruction below (grey: none returned for that image)"
    if max(counts.values()) > MAX_SHOWN:
        head += f"; the first {MAX_SHOWN} of {max(counts.values())} shown"
    if len(cols) == 1:
        head = f"attack: {cols[0]}; {head}"

    def draw(extra_top: float):
        if len(cols) == 1:
            return _wrapped_grid(rows, cols[0], images, cell_w, img_h, extra_top)
        return _table_grid(rows, cols, images, cell_w, img_h, extra_top)

    fig = draw(0.0)
    # The title may be wider than the panels: the saved figure grows to hold it (save_figure), never clips it. One
    # wrapped over several lines (a long case variant) gets room above the panels, which keep their size.
    text = _wrap(title, max(72, int(fig.get_figwidth() * 13))) + "\n" + head
    if text.count("\n") > 1:
        fig = draw(0.16 * (text.count("\n") - 1))
    fig.suptitle(text, fontsize=9, y=1 - 0.08 / fig.get_figheight(), va="top")
    return save_figure(fig, path)


STRENGTH_METRICS = [("psnr", "PSNR (dB), worst case", False), ("ssim", "SSIM", False), ("mse_median", "MSE (median)", True),
                    ("lpips", "LPIPS", False), ("label_acc", "label accuracy", False),
                    ("rouge1", "ROUGE-1 (text), worst case", False)]  # fmt: skip


def _metric_panel(ax, lines, key: str, label: str, logy: bool, baselines) -> bool:
    """One metric against the defense parameter, a colour per attack and a line style per group, the spread over
    seeds as error bars and the undefended value dotted; returns whether a point or the undefended line was drawn at
    the PSNR/MSE bound (each such point a triangle, such a line labelled with its value where it is drawn)."""
    attacks, groups, clipped_any = list(dict.fromkeys(lines["attack"])), list(dict.fromkeys(lines["group"])), False
    cut_bases: list[float] = []
    for a_i, attack in enumerate(attacks):
        color = ATTACK_COLORS[a_i % len(ATTACK_COLORS)]
        for g_i, group in enumerate(groups):
            d = lines[(lines["attack"] == attack) & (lines["group"] == group)].sort_values("x")
            d = d[d[key].notna()]
            if not len(d):
                continue
            ys, clipped = _clip([float(v) for v in d[key]], key)
            ax.plot(d["x"], ys, LINE_STYLES[g_i % len(LINE_STYLES)], marker=MARKERS[g_i % len(MARKERS)], color=color,
                    label=attack + (f" ({group})" if group else ""), markersize=4)  # fmt: skip
            if f"{key}_err" in d and d[f"{key}_err"].notna().any():  # spread over seeds (not at clipped points)
                err = [0.0 if c or e != e else float(e) for e, c in zip(d[f"{key}_err"], clipped)]
                ax.errorbar(d["x"], ys, yerr=err, fmt="none", ecolor=color, elinewidth=0.8, capsize=2, alpha=0.7)
            cx = [x for x, c in zip(d["x"], clipped) if c]
            if cx:
                edge = PSNR_CAP if key == "psnr" else MSE_FLOOR
                ax.scatter(cx, [edge] * len(cx), marker="^" if key == "psnr" else "v", s=40, color=color, zorder=5)
                clipped_any = True
        base = baselines.get(key, {}).get(attack)
        if base is not None:
            (edge,), (cut,) = _clip([base], key)
            ax.axhline(edge, color=color, linestyle=(0, (1, 2)), linewidth=1, alpha=0.8)
            if cut:
                cut_bases.append(base)
    if cut_bases:  # said where it is drawn, once per panel, not only in the title: the dotted line is not the value
        lo, hi = min(cut_bases), max(cut_bases)
        if key == "psnr":
            said = f"no defense: {lo:.0f}" + (f"-{hi:.0f}" if round(hi) != round(lo) else "") + f" dB, drawn at {PSNR_CAP:.0f}"
        else:
            said = (f"no defense: MSE {hi:.0e}" if hi > 0 else "no defense: MSE 0") + (" or less" if lo < hi else "")
            said += f", drawn at {MSE_FLOOR:.0e}"
        edge = PSNR_CAP if key == "psnr" else MSE_FLOOR
        ax.annotate(said, (0.98, edge), xycoords=("axes fraction", "data"), ha="right", va="top" if key == "psnr" else "bottom",
                    fontsize=6.5, color="#333333", xytext=(0, -2 if key == "psnr" else 2), textcoords="offset points")  # fmt: skip
        clipped_any = True
    if logy:
        ax.set_yscale("log")
    if key in ("ssim", "label_acc", "rouge1"):
        ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.05)
    if key == "psnr":
        _band_axis(ax)
    ax.set_ylabel(label)
    return clipped_any


def _accuracy_panel(ax, accuracy, base: float | None) -> None:
    """Test accuracy under the defense against its parameter; the undefended accuracy dotted."""
    for g_i, group in enumerate(list(dict.fromkeys(accuracy["group"]))):
        d = accuracy[accuracy["group"] == group].sort_values("x")
        ax.plot(d["x"], 100 * d["accuracy"], LINE_STYLES[g_i % len(LINE_STYLES)], marker=MARKERS[g_i % len(MARKERS)],
                color="black", label=group or "accuracy", markersize=4)  # fmt: skip
    if base is not None:
        ax.axhline(100 * base, color="black", linestyle=(0, (1, 2)), linewidth=1)
    ax.set_ylabel("test accuracy (%)")
    lo, hi = ax.get_ylim()
    if hi - lo < 5:  # a fraction of a point must not look like a collapse
        mid = (lo + hi) / 2
        ax.set_ylim(mid - 2.5, mid + 2.5)
    if len(set(accuracy["group"])) > 1:
        ax.legend(fontsize=7, loc="best")


def _strength_x_axis(ax, xs: list[float], xkey: str) -> None:
    """Log x where the values span 50x or more; a logit axis for fractions that reach 0.95 and beyond (pruning
    ratios: it keeps 0.9, 0.99 and 0.999 apart), ticked at the values themselves."""
    logx = len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 50
    if logx:
        ax.set_xscale("log")
    elif len(xs) > 1 and min(xs) > 0 and max(xs) < 1 and max(xs) >= 0.95:
        ax.set_xscale("logit")
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
        ax.minorticks_off()
    ax.set_xlabel(xkey)
    ax.grid(True, alpha=0.3)


def _legend_columns(labels: list[str], width: float) -> int:
    """As many legend columns as fit a figure `width` inches wide (about 14 characters per inch at 8 pt)."""
    if not labels:
        return 1
    need = max(len(lab) for lab in labels) + 6
    return max(1, min(4, len(labels), int(width * 14 / need)))


@plain_text
def strength_figure(lines, accuracy, baselines, xkey: str, path: Path, title: str) -> Path:
    """Metrics against one defense parameter. `lines`: DataFrame with attack, group, x and metric columns (one line
    per attack x group); `accuracy`: DataFrame with group, x, accuracy (or None); `baselines`: {metric: {attack:
    value}} of the undefended configuration, drawn as dotted horizontal lines; baselines['accuracy'] a float."""
    metrics = [m for m in STRENGTH_METRICS if m[0] in lines and lines[m[0]].notna().any()]
    with_acc = accuracy is not None and len(accuracy) > 0
    width = 3.3 * (len(metrics) + with_acc) + 0.6
    names = [a + (f" ({g})" if g else "") for a, g in dict.fromkeys(zip(lines["attack"], lines["group"]))] if len(lines) else []
    ncol = _legend_columns(names, width)
    # The key below the panels gets its own height: a suite of many attack variants makes the figure taller, never
    # the panels smaller (or collapsed).
    fig = _figure(width, 3.4 + 0.17 * -(-len(names) // ncol))
    # one x range for every panel: a configuration without an accuracy (a failed utility run) keeps its place
    axes = fig.subplots(1, len(metrics) + with_acc, squeeze=False, sharex=True)[0]
    clipped = [_metric_panel(ax, lines, *m, baselines) for ax, m in zip(axes, metrics)]
    if with_acc:
        _accuracy_panel(axes[-1], accuracy, baselines.get("accuracy"))
    xs = sorted(set(lines["x"]) | (set(accuracy["x"]) if accuracy is not None else set()))
    for ax in axes:
        _strength_x_axis(ax, xs, xkey)
    seen: dict[str, object] = {}
    for ax in axes[: len(metrics)]:  # label-only attacks draw in the label panel only
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=_legend_columns(list(seen), width),
                   fontsize=8, frameon=False)  # fmt: skip
    note = (f"; PSNR above {PSNR_CAP:.0f} dB and MSE below {MSE_FLOOR:.0e} (visually exact) drawn at those bounds, "
            "points there as triangles" if any(clipped) else "")  # fmt: skip
    fig.suptitle(f"{title}  (dotted: no defense{note})", fontsize=10)
    return save_figure(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (accuracy, psnr) points that no other point beats on both (higher accuracy, lower PSNR)."""
    out = []
    for i, (a, p) in enumerate(points):
        dominated = any(
            (a2 >= a and p2 <= p) and (a2 > a or p2 < p) for j, (a2, p2) in enumerate(points) if j != i
        )
        if not dominated:
            out.append(i)
    return out


def _clusters(xs: list[float], ys: list[float], dx: float, dy: float) -> list[list[int]]:
    """Greedy groups of points closer than (dx, dy) to a group's first point, so that their labels are written once."""
    groups: list[list[int]] = []
    for i in range(len(xs)):
        for g in groups:
            if abs(xs[g[0]] - xs[i]) <= dx and abs(ys[g[0]] - ys[i]) <= dy:
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


@plain_text
def frontier_figure(points, path: Path, title: str, baseline_accuracy: float | None = None) -> Path:
    """The privacy-utility frontier: worst-case attack PSNR (lower is more private) against test accuracy, one point
    per defense configuration, the Pareto front marked. `points`: DataFrame with label, accuracy, psnr. Points are
    numbered (coinciding points share one label) and the key under the plot names each configuration."""
    import textwrap

    pts = points[points["accuracy"].notna() & points["psnr"].notna()].reset_index(drop=True)
    labels = list(pts["label"])
    acc = [100 * float(a) for a in pts["accuracy"]]
    raw = [float(p) for p in pts["psnr"]]
    ys, clipped = _clip(raw, "psnr")
    front = pareto_front(list(zip(acc, raw)))
    entries = []
    for i, label in enumerate(labels):
        mark = "*" if i in front else " "
        wrapped = textwrap.wrap(label, 72, break_on_hyphens=False) or [""]
        entries.append([f"{i + 1:>2}{mark} {wrapped[0]}"] + [f"    {w}" for w in wrapped[1:]])
    # The key sits under the plot in two columns (the plot keeps the figure's width), an entry never split between
    # them; a long key makes the figure taller, not the plot flatter.
    total = sum(len(e) for e in entries)
    cols: list[list[str]] = [[], []]
    for e in entries:
        cols[0 if len(cols[0]) + len(e) <= (total + 1) // 2 and not cols[1] else 1].extend(e)
    plot_h, key_h = 4.6, 0.115 * (max(len(cols[0]), len(cols[1])) + 1)  # 6.8 pt monospace lines, as drawn
    fig = _figure(11.0, plot_h + 1.2 + key_h)  # the plot's labels and legend take about 1.2 in of their own
    grid = fig.add_gridspec(2, 1, height_ratios=[plot_h, key_h])
    ax, key_ax = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    plain = [i for i in range(len(pts)) if not clipped[i]]
    high = [i for i in range(len(pts)) if clipped[i]]
    ax.scatter([acc[i] for i in plain], [ys[i] for i in plain], s=28, color="#888888", zorder=2, label="defense configuration")
    if "psnr_err" in pts and pts["psnr_err"].notna().any():  # spread over seeds (not at points drawn at the cap)
        err = [0.0 if clipped[i] or e != e else float(e) for i, e in enumerate(pts["psnr_err"])]
        ax.errorbar(acc, ys, yerr=err, fmt="none", ecolor="#888888", elinewidth=0.8, capsize=2, zorder=1)
    if high:
        ax.scatter([acc[i] for i in high], [ys[i] for i in high], s=40, marker="^", color="#888888", zorder=2,
                   label=f"PSNR above {PSNR_CAP:.0f} dB (visually exact), drawn at {PSNR_CAP:.0f}")  # fmt: skip
    fr = sorted(front, key=lambda i: (acc[i], -raw[i]))
    ax.plot([acc[i] for i in fr], [ys[i] for i in fr], "-", color="#d62728", linewidth=1.5, zorder=3)
    ax.scatter([acc[i] for i in fr], [ys[i] for i in fr], s=70, facecolors="none", edgecolors="#d62728", linewidths=1.5,
               zorder=4, label="Pareto front: no other configuration is both more accurate and less leaky")  # fmt: skip
    top = max(max(ys, default=RECOVERED_PSNR), RECOVERED_PSNR) + 4
    ax.set_ylim(max(0.0, min(min(ys, default=PARTIAL_PSNR), PARTIAL_PSNR) - 3), top)
    x_lo, x_hi = min(acc, default=0.0), max(acc, default=100.0)
    span = max(x_hi - x_lo, 1.0)
    ax.set_xlim(x_lo - 0.05 * span, x_hi + 0.12 * span)
    y_lo, y_hi = ax.get_ylim()
    for group in _clusters(acc, ys, 0.02 * span, 0.03 * (y_hi - y_lo)):
        text = ",".join(str(i + 1) for i in group)
        on_front = any(i in front for i in group)
        ax.annotate(text, (acc[group[0]], ys[group[0]]), xytext=(5, 3), textcoords="offset points", fontsize=7.5,
                    color="#b00020" if on_front else "#444444", fontweight="bold" if on_front else "normal")  # fmt: skip
    if baseline_accuracy is not None:
        ax.axvline(100 * baseline_accuracy, color="black", linestyle=(0, (1, 2)), linewidth=1, label="no defense (accuracy)")
    _band_axis(ax)
    ax.set_xlabel("test accuracy (%) of federated training under the defense")
    ax.set_ylabel("worst-case attack PSNR (dB): lower is more private")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncol=2)
    key_ax.axis("off")
    key_ax.text(0.0, 1.0, "key (* on the Pareto front)\n" + "\n".join(cols[0]), va="top", ha="left", family="monospace",
                fontsize=6.8, transform=key_ax.transAxes)  # fmt: skip
    key_ax.text(0.5, 1.0, "\n" + "\n".join(cols[1]), va="top", ha="left", family="monospace", fontsize=6.8,
                transform=key_ax.transAxes)  # fmt: skip
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def _shared_terms(labels: list[str]) -> tuple[list[str], list[str]]:
    """(the "key=value" terms every label shares, each label without them): a panel's title names what its lines
    share, its key only what tells them apart."""
    terms = [[t.strip() for t in lab.replace(" ", ", ", 1).split(", ")] if " " in lab else [lab] for lab in labels]
    shared = [t for t in terms[0] if all(t in ts for ts in terms[1:])] if len(terms) > 1 else terms[0][:1]
    rest = [", ".join(t for t in ts if t not in shared) or ts[0] for ts in terms]
    return shared, rest


@plain_text
def curves_figure(curves: list[tuple[str, str, list[list[float]]]], path: Path, title: str) -> Path:
    """Test accuracy against round for each utility run (to see that the baseline converged): one panel per defense
    and setting (runs that differ only in their last parameter share one), the undefended run in black in each,
    distinct colours within a panel (a line style more past 10). `curves`: (defense, label, points)."""
    import textwrap

    from matplotlib import colormaps

    base = [pts for d, _, pts in curves if d == "none" and pts]
    # A panel per defense and setting: runs that differ in more than their last parameter (Gaussian or Laplace
    # noise, a fixed sigma or a DP target) get panels of their own, so that no panel holds a dozen lines.
    panel_of = [(d, lab.rsplit(", ", 1)[0] if ", " in lab else d) for d, lab, _ in curves]
    families = list(dict.fromkeys(k for k, (d, _, pts) in zip(panel_of, curves) if d != "none" and pts))
    if not families:
        families = [("none", "none")]
    ncol = min(4, len(families))
    nrow = -(-len(families) // ncol)
    fig = _figure(4.4 * ncol + 0.4, 3.9 * nrow + 0.6)
    axes = fig.subplots(nrow, ncol, squeeze=False, sharey=True)
    palette = colormaps["tab10"].colors
    for ax, fam in zip(axes.flat, families):
        mine = [(lab, pts) for k, (_, lab, pts) in zip(panel_of, curves) if k == fam and pts]
        shared, short = _shared_terms([lab for lab, _ in mine])
        for i, ((_, pts), lab) in enumerate(zip(mine, short)):
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], LINE_STYLES[(i // 10) % len(LINE_STYLES)],
                    color=palette[i % 10], linewidth=1.2, label=textwrap.fill(lab, 44, break_on_hyphens=False))  # fmt: skip
        if base and fam[0] != "none":
            ax.plot([p[0] for p in base[0]], [100 * p[1] for p in base[0]], color="black", linewidth=2.0, zorder=3,
                    label="no defense")  # fmt: skip
        ax.set_title(textwrap.fill(", ".join(shared), 60, break_on_hyphens=False), fontsize=8.5)
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6.5, loc="best", frameon=True, framealpha=0.85)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    for ax in list(axes.flat)[len(families):]:
        ax.axis("off")
    fig.suptitle(title + "  (one panel per defense; black: no defense)", fontsize=10)
    return save_figure(fig, path)
