"""What kept libraries now do in place of hand-written code, and code of ours that must equal a library's: the image
grid (torchvision make_grid's layout, laid out by gleak to spare every worker torchvision's import), the Markdown
tables (tabulate) and the HTML page (jinja2) of the reports, the folder lock (filelock). Each keeps its contract."""
import os
import re

import numpy as np
import pytest
import torch

from gleak.contracts.errors import InputError
from gleak.orchestration.folder_lock import LOCK_NAME, check_unlocked, release_lock, take_lock
from gleak.reporting.documents.markdown import md_table
from gleak.reporting.figures import image_grid
from gleak.reporting.documents.html import render_html


def test_image_grid_layout_padding_scale_and_a_short_row():
    a = torch.tensor([[[[0.0, 1.0], [0.5, 0.25]]]])  # one grey 2x2 image
    rows = [torch.cat([a, 1 - a]), a]  # two images above, one below (the empty cell is white)
    g = image_grid(rows, scale=2, pad=1)
    assert g.shape == (2 * (4 + 1) + 1, 2 * (4 + 1) + 1, 3) and g.dtype == np.uint8
    assert (g[0] == 255).all() and (g[:, 0] == 255).all() and (g[5] == 255).all()  # padding, white
    cell = g[1:5, 1:5, 0]
    assert cell.tolist() == [[0, 0, 255, 255], [0, 0, 255, 255], [128, 128, 64, 64], [128, 128, 64, 64]]
    assert (g[1:5, 1:5, 0] == g[1:5, 1:5, 2]).all()  # grey on all three channels
    assert g[1:5, 6:10, 0].tolist()[0] == [255, 255, 0, 0]  # the second image, 1 - a
    assert (g[6:10, 6:10] == 255).all()  # the short row's missing cell


@pytest.mark.parametrize("seed", range(4))
def test_image_grid_equals_torchvisions_make_grid_of_the_same_cells(seed):
    """The grid is torchvision.utils.make_grid's layout byte for byte (published PNGs were drawn with it): random
    sizes, grey or colour, rows of unequal length filled with white cells."""
    from torchvision.utils import make_grid

    g = torch.Generator().manual_seed(seed)
    c, h, w = (1, 3)[seed % 2], 2 + seed, 3 + 2 * seed
    rows = [torch.rand(int(torch.randint(1, 5, (1,), generator=g)), c, h, w, generator=g) * 1.4 - 0.2 for _ in range(3)]
    scale, pad = 1 + seed % 3, seed % 3
    n = max(len(r) for r in rows)
    cells = []
    for r in rows:
        r = r.double().clamp(0, 1).expand(-1, 3, -1, -1)[:, :3].repeat_interleave(scale, -2).repeat_interleave(scale, -1)
        cells += [*r, *torch.ones((n - len(r), *r.shape[1:]), dtype=r.dtype)]
    want = (make_grid(cells, nrow=n, padding=pad, pad_value=1.0) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(image_grid(rows, scale=scale, pad=pad), want)


def test_markdown_table_keeps_the_cells_as_formatted():
    text = md_table(["defense", "psnr", "verdict"], [["none", "1.50", "recovered"], ["topk (ratio=0.9)", "12.0", "10,000"]])
    lines = text.splitlines()
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    assert cells[0] == ["defense", "psnr", "verdict"] and set("".join(cells[1])) <= {"-"}
    assert cells[2:] == [["none", "1.50", "recovered"], ["topk (ratio=0.9)", "12.0", "10,000"]]  # 1.50 not 1.5
    assert all(ln.startswith("| ") and ln.endswith(" |") for ln in lines if not ln.startswith("|-"))


def test_html_page_escapes_marks_numbers_and_verdicts_and_embeds_figures(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "f.png")
    doc = [("h1", "Suite <b>x</b>"), ("p", "run `gleak plot` & see"),
           ("table", ["attack", "psnr", "verdict"], [["<script>alert(1)</script>", "12.5", "recovered"]]),
           ("list", ["one `a`"]), ("figure", "f.png", 'cap "q"'), ("figure", "missing.png", "gone")]  # fmt: skip
    page = render_html(doc, tmp_path)
    assert page.startswith("<!DOCTYPE html>\n") and page.endswith("</html>\n")
    assert "<title>Suite &lt;b&gt;x&lt;/b&gt;</title>" in page and "<h1>Suite &lt;b&gt;x&lt;/b&gt;</h1>" in page
    assert "<p>run <code>gleak plot</code> &amp; see</p>" in page and "<li>one <code>a</code></li>" in page
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert '<td class="num">12.5</td>' in page and '<td class="verdict-recovered">recovered</td>' in page
    assert 'font: 14px/1.45 system-ui, -apple-system, "Segoe UI"' in page  # the style, not escaped
    assert len(re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]+"', page)) == 1 and "missing.png" not in page
    small = render_html(doc, tmp_path, max_embed_bytes=1)
    assert "<img" not in small and "Figure not embedded (page size limit): f.png." in small


def test_folder_lock_refuses_a_second_holder_names_it_and_is_released(tmp_path):
    folder = tmp_path / "out"
    check_unlocked(folder)
    assert not folder.exists()  # the probe creates nothing
    lock = take_lock(folder)
    assert (folder / LOCK_NAME).read_text() == str(os.getpid())
    for attempt in (take_lock, check_unlocked):
        with pytest.raises(InputError, match=rf"another gleak run \(pid {os.getpid()}\) is writing here"):
            attempt(folder)
    release_lock(lock)
    check_unlocked(folder)
    release_lock(take_lock(folder))
    assert (folder / LOCK_NAME).is_file()  # stays, so that waiters share one file
