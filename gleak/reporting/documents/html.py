"""The leaderboard's blocks (gleak.reporting.documents.leaderboard) as one self-contained HTML page."""
from __future__ import annotations

from pathlib import Path
from typing import Any

_HTML_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1400px;
       padding: 0 1em; color: #1a1a1a; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 12.5px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; position: sticky; top: 0; }
tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.verdict-recovered { color: #b00020; font-weight: 600; } .verdict-partial { color: #b35c00; }
.verdict-defended { color: #1b7a2b; font-weight: 600; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 12.5px; } code { background: #f4f4f4; padding: 0 3px; border-radius: 3px; }
.scroll { overflow-x: auto; }
"""


def _html_inline(text: str) -> str:
    """Escape, then turn `code` spans into <code>."""
    import html
    import re

    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _cell_class(value: str, header: str) -> str:
    """The CSS classes of a table cell: num for a number, verdict-* for a verdict."""
    import re

    cls = []
    if re.fullmatch(r"[-+]?(\d[\d.,]*(e[-+]?\d+)?%?|inf)", value.strip()):
        cls.append("num")
    for word in ("recovered", "partial", "defended"):
        if header in ("verdict",) and value == word or re.search(rf"\({word}\)$", value):
            cls.append(f"verdict-{word}")
    return " ".join(cls)


# The page (jinja2, autoescaped): texts that may hold `code` spans arrive as Markup from _html_inline, everything else
# is escaped by the template. trim_blocks/lstrip_blocks: one line per element, as a hand-written page would have.
_HTML_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ title }}</title>
<style>{{ style | safe }}</style>
</head>
<body>
{% for b in blocks %}
{% if b.kind in ("h1", "h2", "h3") %}
<{{ b.kind }}>{{ b.text }}</{{ b.kind }}>
{% elif b.kind == "p" %}
<p>{{ b.text }}</p>
{% elif b.kind == "table" %}
<div class="scroll"><table>
<thead><tr>{% for h in b.header %}<th>{{ h }}</th>{% endfor %}</tr></thead><tbody>
{% for row in b.rows %}
<tr>{% for value, cls in row %}<td{% if cls %} class="{{ cls }}"{% endif %}>{{ value }}</td>{% endfor %}</tr>
{% endfor %}
</tbody></table></div>
{% elif b.kind == "list" %}
<ul>{% for item in b.entries %}<li>{{ item }}</li>{% endfor %}</ul>
{% elif b.kind == "figure" and b.uri %}
<figure><img src="{{ b.uri }}" alt="{{ b.alt }}"><figcaption>{{ b.caption }}</figcaption></figure>
{% elif b.kind == "figure" %}
<p>Figure not embedded (page size limit): {{ b.name }}. {{ b.caption }}</p>
{% endif %}
{% endfor %}
</body>
</html>
"""


def render_html(doc: list[tuple], folder: Path, max_embed_bytes: int = 3 << 20) -> str:
    """A self-contained page: inline CSS, figures embedded as data URIs (no file or network reference)."""
    import base64

    import jinja2
    from markupsafe import Markup

    from gleak.reporting.documents.cells import unmarked

    def plain(v: Any) -> Any:  # data marks off, control characters out of the data: autoescape does the rest
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else unmarked(v) if isinstance(v, str) else v

    doc = [(b[0], *(plain(x) for x in b[1:])) for b in doc]
    blocks: list[dict[str, Any]] = []
    embedded = 0
    for block in doc:
        kind = block[0]
        if kind in ("h1", "h2", "h3", "p"):
            blocks.append({"kind": kind, "text": Markup(_html_inline(block[1]))})
        elif kind == "table":
            header = block[1]
            rows = [[(c, _cell_class(c, h)) for c, h in zip(r, header)] for r in block[2]]
            blocks.append({"kind": kind, "header": header, "rows": rows})
        elif kind == "list":
            blocks.append({"kind": kind, "entries": [Markup(_html_inline(i)) for i in block[1]]})
        elif kind == "figure":
            f = folder / block[1]
            if not f.is_file():
                continue
            data = f.read_bytes()
            fig = {"kind": kind, "name": block[1], "alt": block[2], "caption": Markup(_html_inline(block[2])), "uri": None}
            if embedded + len(data) <= max_embed_bytes:
                embedded += len(data)
                fig["uri"] = "data:image/png;base64," + base64.b64encode(data).decode()
            blocks.append(fig)
    env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    title = next((b[1] for b in doc if b[0] == "h1"), "gleak leaderboard")
    return env.from_string(_HTML_PAGE).render(title=title, style=_HTML_STYLE, blocks=blocks)

