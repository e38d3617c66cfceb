"""A picture of a report page's decision block (the README's): headless Chromium, cropped to the block, a small PNG.

Takes a rendered benchmark page (reports/links.py `page_name`: reports/html/<bench>__<model>.html, written by
`make census` / `make reports`) and writes a PNG of its decision block only (`<section id="decision">`,
reports/decision.py): Chromium lays the page out at a fixed window width and reports the block's box (on a copy
of the page without its Content-Security-Policy, which forbids the one script that measures), then screenshots
the page itself down to the block's bottom, and Pillow crops to the block with a small margin. A PNG over
300 KB is reduced to fewer colours until it fits; one that never fits is an error.

Usage: python benchmarks/screenshot_report.py [--page reports/html/apibank__smollm2-135m.html]
           [--out docs/img/decision-apibank.png] [--width 1200] [--chromium PATH]
Every failure (no page, no decision block, no Chromium, no Pillow, Chromium failing) is one line
`error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html import unescape
from pathlib import Path

from data.errors import OilbirdError, cli_entry

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "reports" / "html" / "apibank__smollm2-135m.html"
OUT = REPO / "docs" / "img" / "decision-apibank.png"
BLOCK_ID = "decision"  # reports/decision.py decision_section: <section id="decision">
MAX_BYTES = 300_000
MARGIN = 16  # pixels of page kept around the block
COLOURS = (256, 128, 64, 32)  # palettes tried, in turn, when the full-colour PNG is over MAX_BYTES
TIMEOUT_S = 120

# Writes into the title the block's box in page coordinates and the page's width (the page has no script of its
# own; this runs only in the measuring copy).
MEASURE = ("<script>(function(){var b=document.getElementById('" + BLOCK_ID + "'),e=document.documentElement;"
           "var r=b?b.getBoundingClientRect():null;document.title=JSON.stringify(r?{left:r.left+scrollX,"
           "top:r.top+scrollY,right:r.right+scrollX,bottom:r.bottom+scrollY,page:e.scrollWidth}:{missing:true})"
           "})()</script>")


def find_chromium(given: str | None) -> str:
    if given:
        path = shutil.which(given)
        if path is None:
            raise OilbirdError(f"--chromium {given}: no such program")
        return path
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    raise OilbirdError("no chromium on PATH or at /usr/bin/chromium: install it "
                       "(apt-get install chromium) or name it with --chromium")


def chromium(binary: str, profile: Path, width: int, height: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
           "--force-device-scale-factor=1", f"--user-data-dir={profile}", f"--window-size={width},{height}", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise OilbirdError(f"{binary} did not finish in {TIMEOUT_S} s") from None


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def block_box(binary: str, page: Path, tmp: Path, width: int) -> dict:
    """The decision block's box in page pixels at `width`: {left, top, right, bottom, page}."""
    text = page.read_text(encoding="utf-8", errors="replace")
    if f'id="{BLOCK_ID}"' not in text:
        raise OilbirdError(f"{page} has no decision block (<section id=\"{BLOCK_ID}\">): give a benchmark's page, "
                           "<bench>__<model>.html")
    text = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", text, count=1)
    probe = tmp / "measure.html"
    probe.write_text(text.replace("</body>", MEASURE + "</body>", 1) if "</body>" in text else text + MEASURE,
                     encoding="utf-8")
    proc = chromium(binary, tmp / "profile", width, 900, "--dump-dom", probe.as_uri())
    m = re.search(r"<title>(\{.*?\})</title>", proc.stdout, re.S)
    if not m:
        raise OilbirdError(f"{binary} did not lay out {page} (exit {proc.returncode}: {last_line(proc.stderr)})")
    box = json.loads(unescape(m.group(1)))
    if box.get("missing") or not box.get("bottom", 0) > box.get("top", 0):
        raise OilbirdError(f"{page}: the decision block was not laid out (an empty or hidden block)")
    return box


def shoot(binary: str, page: Path, tmp: Path, width: int, height: int) -> bytes:
    shot = tmp / "page.png"
    proc = chromium(binary, tmp / "profile", width, height, f"--screenshot={shot}", page.as_uri())
    if not shot.exists() or shot.stat().st_size == 0:
        raise OilbirdError(f"{binary} wrote no screenshot of {page} (exit {proc.returncode}: "
                           f"{last_line(proc.stderr)})")
    return shot.read_bytes()


def crop_png(png: bytes, box: dict) -> tuple[bytes, str]:
    """The block cut out of the screenshot with MARGIN pixels around it, as the smallest PNG that holds it under
    MAX_BYTES: full colour first, then fewer colours. Returns (png, what was done)."""
    try:
        from PIL import Image
    except ImportError:
        raise OilbirdError("Pillow is not installed in this Python (it comes with matplotlib): "
                           "run the script with the project's .venv/bin/python") from None
    with Image.open(io.BytesIO(png)) as full:
        img = full.convert("RGB")
    left, top = max(0, int(box["left"]) - MARGIN), max(0, int(box["top"]) - MARGIN)
    right = min(img.width, int(box["right"] + 0.999) + MARGIN)
    bottom = min(img.height, int(box["bottom"] + 0.999) + MARGIN)
    if right - left < 50 or bottom - top < 20 or bottom <= int(box["top"]):
        raise OilbirdError(f"the screenshot ({img.width}×{img.height}) does not hold the decision block at "
                           f"{int(box['left'])},{int(box['top'])}–{int(box['right'])},{int(box['bottom'])}")
    img = img.crop((left, top, right, bottom))
    for n in (None, *COLOURS):
        im = img if n is None else img.quantize(colors=n, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        how = "full colour" if n is None else f"{n} colours"
        buf = io.BytesIO()
        im.save(buf, "PNG", optimize=True)
        if buf.tell() <= MAX_BYTES:
            return buf.getvalue(), f"{img.width}×{img.height}, {how}"
    raise OilbirdError(f"the decision block ({img.width}×{img.height} px) does not fit in {MAX_BYTES // 1000} KB "
                       f"even at {COLOURS[-1]} colours: give a smaller --width")


def write_atomically(out: Path, data: bytes) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other failure (argparse prints the usage too)
        raise OilbirdError(message)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    ap = Parser(description="PNG of a report page's decision block (headless Chromium).")
    ap.add_argument("--page", type=Path, default=PAGE, help="a rendered benchmark page (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=OUT, help="the PNG to write (default: %(default)s)")
    ap.add_argument("--width", type=int, default=1200, help="browser window width in pixels (default: %(default)s)")
    ap.add_argument("--chromium", help="the Chromium program (default: chromium on PATH, else /usr/bin/chromium)")
    args = ap.parse_args(argv)
    if not 400 <= args.width <= 4000:
        raise OilbirdError(f"--width {args.width}: give 400 to 4000 pixels")
    if args.out.is_dir():
        raise OilbirdError(f"--out {args.out} is a folder: name the PNG file")
    page = args.page.resolve()
    if not page.is_file():
        how = ("`make census BENCH=apibank` renders it (`make reports` re-renders every page)" if args.page == PAGE
               else "`make reports` renders a benchmark's page as reports/html/<bench>__<model>.html")
        raise OilbirdError(f"no page at {args.page}: {how}")
    binary = find_chromium(args.chromium)
    with tempfile.TemporaryDirectory(prefix="oilbird-shot-") as tmp:
        box = block_box(binary, page, Path(tmp), args.width)
        height = int(box["bottom"] + 0.999) + MARGIN + 8
        if height > 16_000:
            raise OilbirdError(f"the decision block ends {height} px down the page, past what one screenshot holds")
        png, how = crop_png(shoot(binary, page, Path(tmp), args.width, height), box)
    write_atomically(args.out, png)
    print(f"{args.out}: {len(png) / 1000:.0f} KB, {how} (the decision block of {args.page} at {args.width} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
