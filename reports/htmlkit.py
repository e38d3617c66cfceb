"""The HTML kit every page is built from: escaping, number formatting, tables, sections, "not available"
lines and the page shell (inline CSS, no script, a Content-Security-Policy that forbids every fetch).

Cells are built from already-escaped text: whatever comes from a file (a model's text, an arm or a
benchmark name, a note) goes through `esc` before it reaches a cell, a title attribute or a heading.
A number that is missing or not finite shows as "n/a", never as a guess.
"""

from __future__ import annotations

import html
import math
import urllib.parse

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
CSS = """
:root{--fg:#1b1b1b;--muted:#5f6368;--line:#dadce0;--soft:#f4f6f9}
*{box-sizing:border-box}
body{margin:0;color:var(--fg);background:#fff;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,"Liberation Sans",sans-serif;overflow-wrap:break-word}
nav{background:var(--soft);border-bottom:1px solid var(--line);padding:.5rem 1.5rem;font-size:.9rem}
nav a{margin-right:1rem}
main{max-width:1240px;margin:0 auto;padding:1rem 1.5rem 3rem}
main.wide{max-width:1900px}
h1{font-size:1.55rem;margin:.6rem 0 .2rem}
h2{font-size:1.2rem;margin:2rem 0 .5rem;padding-bottom:.2rem;border-bottom:1px solid var(--line)}
h3{font-size:1rem;margin:1.2rem 0 .3rem}
.sub{color:var(--muted);margin:0 0 1rem}
.headline{font-size:1.05rem;background:#eef4fb;border-left:4px solid #0072B2;padding:.7rem 1rem;margin:1rem 0}
.callout{background:var(--soft);border-left:4px solid #888;padding:.6rem 1rem;margin:.8rem 0}
.callout.enable{border-left-color:#009E73;background:#eaf6f0}
.callout.off{border-left-color:#D55E00;background:#fcefe9}
.callout.neutral{border-left-color:#E69F00;background:#fdf5e6}
.callout.stale{border-left-color:#CC79A7;background:#fbeef5}
.callout.cannot{border-left-color:#000;background:#eeeeee;border-left-style:double;border-left-width:6px}
.spread.sensitive{border-top:2px dashed #CC79A7;padding-top:.3rem}
.flag{display:inline-block;font-size:.75rem;font-weight:600;color:#7a2855;background:#fbeef5;
border:1px solid #CC79A7;border-radius:3px;padding:0 .3rem;margin-left:.2rem;white-space:nowrap}
.table-scroll{max-width:100%;overflow-x:auto}  /* a table wider than the page scrolls in its box, not the page */
table{border-collapse:collapse;margin:.5rem 0 1rem;font-size:.88rem}
th,td{padding:.25rem .65rem;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
thead th{border-bottom:2px solid #bbb}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.num{white-space:nowrap}  /* a number stays on one line; its header wraps */
tr.group th{background:var(--soft);font-weight:600}
.na{color:var(--muted);font-style:italic}
.note,.caption,figcaption{color:var(--muted);font-size:.88rem}
svg.chart{display:block;width:100%;height:auto;margin:.4rem 0}
.legend{list-style:none;padding:0;margin:.5rem 0;display:flex;flex-wrap:wrap;gap:.6rem}
.swatch{padding:.1rem .5rem;border-radius:3px;font-size:.88rem}
figure.case{margin:1rem 0}
figure.case figcaption{margin-bottom:.3rem}
.tokens{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono","Liberation Mono",monospace;
font-size:.82rem;line-height:1.75;white-space:pre-wrap;overflow-wrap:anywhere;border:1px solid var(--line);
border-radius:4px;padding:.6rem .7rem;max-height:30rem;overflow:auto}
.tokens span{border-radius:2px}
.p{background:#d6e6f5}
.r{background:#9fdfbf;text-decoration:underline 2px #009E73}
.g{background:#f6bfae;text-decoration:underline wavy #D55E00}
.u{background:#ececec;color:#555}
.more{color:var(--muted);font-size:.85rem}
code{font-size:.88em}
@media print{
  nav{display:none}
  main{max-width:none;padding:0}
  body{font-size:11pt}
  *{-webkit-print-color-adjust:exact;print-color-adjust:exact}
  svg.chart,table,.headline,.callout{break-inside:avoid}
  h2,h3{break-after:avoid}
  .tokens,.table-scroll{max-height:none;overflow:visible}
  a{color:inherit;text-decoration:none}
}
"""
WIDE = ' class="wide"'  # a page whose tables are wider than the reading column (the grid)


def esc(text) -> str:
    """Text made safe for HTML content and attribute values (quotes included)."""
    return html.escape(str(text), quote=True)


def finite(v) -> bool:
    """A real number (not a bool, not NaN or infinite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pct(v) -> str:
    if not finite(v):
        return "n/a"
    x = 100 * v
    return f"{x:.2f}%" if abs(x) < 10 else f"{x:.1f}%"


def interval(iv, kind: str = "pct") -> str:
    if not (isinstance(iv, (list, tuple)) and len(iv) == 2 and all(finite(x) for x in iv)):
        return "n/a"
    if kind == "pct":
        return f"{pct(iv[0]).rstrip('%')}–{pct(iv[1])}"
    return f"{number(iv[0], kind)}–{number(iv[1], kind)}"


def number(v, kind: str = "num") -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if not finite(v):
        return "n/a" if v is None or isinstance(v, (int, float)) else esc(v)
    if kind == "pct":
        return pct(v)
    if kind == "ratio":
        return f"{v:.2f}×"
    if kind == "2f":  # tau: always two decimals
        return f"{v:.2f}"
    if kind == "3f":  # probabilities, calibration errors
        return f"{v:.3f}"
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:.2f}" if abs(v) < 100 else f"{v:,.1f}"


def with_iv(v, iv, kind: str = "2f") -> str:
    """A number and, when known, its 95% interval in brackets."""
    s, i = number(v, kind), interval(iv, kind)
    return s if s == "n/a" or i == "n/a" else f"{s} [{i}]"


def gain_text(v, iv) -> str:
    """A paired ratio as ×1.040 [1.010–1.070]."""
    if not finite(v):
        return "n/a"
    i = iv if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(finite(x) for x in iv) else None
    return f"×{v:.3f}" + (f" [{i[0]:.3f}–{i[1]:.3f}]" if i else "")


def humanize(key: str) -> str:
    return key.replace("_", " ").replace("|", " ∪ ").replace("~", " ~ ")


def table(head: list[str], rows: list[list[str]], num_cols: set[int] = frozenset(), caption: str = "") -> str:
    """A table from already-escaped cells; columns in num_cols are right-aligned. The table sits in a box as wide
    as the page (`table-scroll`): headers wrap, and a table still wider than the page scrolls inside that box, so
    the page itself never scrolls sideways."""
    cap = f'<p class="caption">{caption}</p>' if caption else ""
    th = "".join(f'<th{" class=num" if i in num_cols else ""}>{h}</th>' for i, h in enumerate(head))
    body = []
    for row in rows:
        if len(row) == 1:  # a group header spanning the table
            body.append(f'<tr class="group"><th colspan="{len(head)}">{row[0]}</th></tr>')
            continue
        body.append("<tr>" + "".join(f'<td{" class=num" if i in num_cols else ""}>{c}</td>'
                                     for i, c in enumerate(row)) + "</tr>")
    return (f'{cap}<div class="table-scroll"><table><thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody>'
            "</table></div>")


def not_available(why: str) -> str:
    return f'<p class="na">not available: {esc(why)}</p>'


def na(why: str) -> str:
    """A table cell that is not known, with the reason."""
    return f'<span class="na">n/a: {esc(why)}</span>'


def page(title: str, body: str, wide: bool = False) -> str:
    links = '<nav><a href="index.html">All results</a><a href="grid.html">Cross-benchmark grid</a></nav>'
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<meta name="referrer" content="no-referrer">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head>\n"
            f"<body>{links}<main{WIDE if wide else ''}>\n{body}\n</main></body></html>\n")


def section(sid: str, title: str, *parts: str) -> str:
    return f'<section id="{esc(sid)}"><h2>{esc(title)}</h2>\n' + "\n".join(p for p in parts if p) + "</section>\n"


def href(name: str) -> str:
    """A link to a generated page: the name percent-encoded (a '#' or '?' in a benchmark's file name would
    otherwise cut the link), then escaped for the attribute."""
    return esc(urllib.parse.quote(name, safe=""))
