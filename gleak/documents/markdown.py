"""The leaderboard's blocks (gleak.documents.leaderboard) as GitHub-flavoured Markdown."""
from __future__ import annotations


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (tabulate). The cells are text already formatted (numbers to their shown
    precision, escaped): disable_numparse keeps tabulate from reformatting or realigning them as numbers."""
    from tabulate import tabulate

    return tabulate(rows, headers=header, tablefmt="github", disable_numparse=True)


def md_escape(text: str) -> str:
    """Text for Markdown: outside `code` spans, what would start HTML markup (a tag, an entity, a quote at the start
    of a line) as entities, so that a name, a parameter or a description is shown as written, never as markup."""
    import re

    def plain(p: str) -> str:  # only what could start markup: "MSE < 0.03" stays as it is
        p = re.sub(r"&(?=#?\w+;)", "&amp;", p)
        return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p)

    parts = re.split(r"(`[^`]*`)", str(text))
    out = "".join(p if p.startswith("`") and p.endswith("`") and len(p) > 1 else plain(p) for p in parts)
    return re.sub(r"(?m)^(\s*)>", r"\1&gt;", out)


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
            cell = lambda c: e(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731 - one row per line
            out += [md_table([cell(h) for h in block[1]], [[cell(c) for c in r] for r in block[2]]), ""]
        elif kind == "list":
            out += [f"- {e(item)}" for item in block[1]] + [""]
        elif kind == "figure":
            cap = e(block[2]).replace("[", "\\[").replace("]", "\\]")
            out += [f"![{cap}]({block[1]})", "", f"*{e(block[2])}*", ""]
    return "\n".join(out)

