"""The leaderboard's blocks (gleak.reporting.documents.leaderboard) as GitHub-flavoured Markdown."""
from __future__ import annotations


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (tabulate). The cells are text already formatted (numbers to their shown
    precision, escaped): disable_numparse keeps tabulate from reformatting or realigning them as numbers."""
    from tabulate import tabulate

    return tabulate(rows, headers=header, tablefmt="github", disable_numparse=True)


def md_escape(text: str) -> str:
    """Text for Markdown: outside `code` spans, what would start HTML markup (a tag, an entity, a quote at the start
    of a line) as entities, so that a name, a parameter or a description is shown as written, never as markup.
    Parts marked as data (gleak.reporting.documents.cells.data) are escaped as data: md_data."""
    return _render_text(text, cell=False)


def md_data(text: str, in_code: bool = False, line_start: bool = False, before: str = "", after: str = "") -> str:
    r"""Data (a plugin's name, parameters or error, the suite's text) as Markdown that shows it as written and is
    never structure. Control characters are dropped. Outside a code span: a backslash before `\`, `|` and each
    backtick (no escape of gleak's, no table cell, no code span), before a `#` that starts a line (no heading); a `<` that
    would start a tag or an autolink and a `>` that starts a line (a quote) as entities; and where the data could
    make a link or an image (a `]` followed by `(` or `[`, a `![`, a `[^`, a line `[label]: ...`, also across the
    text around it: `before` and `after` are the characters beside it), a backslash before every `[`, `]`, `(`, `)` and `!` in it. Brackets that make nothing,
    as in "U[0,1]" or "the [utility] seed" of a suite's description, stay as written. Inside one of gleak's code
    spans: a backtick as a quote (nothing else is markup there)."""
    import re

    from gleak.contracts.escaping import strip_controls

    text = strip_controls(text)
    if in_code:
        return text.replace("`", "'")
    around = f"{before[-1:]}{text}{after[:1]}"
    definition = r"(?m)^ {0,3}\[[^\]]*\]:" if line_start else r"\n {0,3}\[[^\]]*\]:"  # [label]: url, a line of its own
    links = re.search(r"\][(\[]|!\[|\[\^", around) is not None or re.search(definition, text) is not None
    text = re.sub(r"([\\|`\[\]()!])" if links else r"([\\|`])", r"\\\1", text)
    text = re.sub(r"&(?=#?\w+;)", "&amp;", text)
    text = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text)  # what starts a tag, a comment or an autolink; "a < b" stays
    text = re.sub(r"(?m)^(\s*)>", r"\1&gt;", text) if line_start else re.sub(r"(\n\s*)>", r"\1&gt;", text)
    return re.sub(r"(?m)^(\s*)#", r"\1\\#", text) if line_start else re.sub(r"(\n\s*)#", r"\1\\#", text)


def _gleak_escape(text: str) -> str:
    """gleak's own text (its sentences, headers and numbers): only what could start HTML markup, as entities."""
    import re

    def plain(p: str) -> str:  # only what could start markup: "MSE < 0.03" stays as it is
        p = re.sub(r"&(?=#?\w+;)", "&amp;", p)
        return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p)

    parts = re.split(r"(`[^`]*`)", str(text))
    out = "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else plain(p) for p in parts)
    return re.sub(r"(?m)^(\s*)>", r"\1&gt;", out)


def _render_text(text: str, cell: bool) -> str:
    """gleak's text escaped as before (so that a leaderboard without data in it is byte for byte what it was), each
    data part put in its place escaped as data; in a table cell, line breaks as spaces and `|` escaped."""
    import re

    from gleak.reporting.documents.cells import DATA_CLOSE, DATA_OPEN

    text = str(text)
    pieces: list[str] = []

    def hold(m: re.Match) -> str:  # a placeholder no escape touches: private use characters and digits
        pieces.append(m.group(1))
        return f"\ue002{len(pieces) - 1}\ue003"

    own = re.sub(f"{DATA_OPEN}([^{DATA_CLOSE}]*){DATA_CLOSE}", hold, text).replace(DATA_OPEN, "").replace(DATA_CLOSE, "")
    own = _gleak_escape(own)
    if cell:
        own = own.replace("|", "\\|").replace("\n", " ")
    if not pieces:
        return own

    def put(m: re.Match) -> str:
        before = own[: m.start()]
        in_code = before.count("`") % 2 == 1  # inside one of gleak's code spans
        line_start = re.search(r"(^|\n)\s*$", before) is not None
        out = md_data(pieces[int(m.group(1))], in_code, line_start, before, own[m.end():m.end() + 1])
        if cell:
            out = out.replace("\n", " ")
            if in_code:
                out = out.replace("|", "\\|")
        return out

    return re.sub("\ue002(\\d+)\ue003", put, own)


def render_markdown(doc: list[tuple]) -> str:
    out: list[str] = []
    e = md_escape
    for block in doc:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out += ["#" * int(kind[1]) + " " + e(block[1]).replace("\n", " "), ""]
        elif kind == "p":
            out += [e(block[1]), ""]
        elif kind == "table":
            cell = lambda c: _render_text(c, cell=True)  # noqa: E731 - one row per line
            out += [md_table([cell(h) for h in block[1]], [[cell(c) for c in r] for r in block[2]]), ""]
        elif kind == "list":
            out += [f"- {e(item)}" for item in block[1]] + [""]
        elif kind == "figure":
            cap = e(block[2]).replace("[", "\\[").replace("]", "\\]")
            out += [f"![{cap}]({block[1]})", "", f"*{e(block[2])}*", ""]
    return "\n".join(out)
