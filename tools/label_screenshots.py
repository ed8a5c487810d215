"""Screenshots of the labelling page for docs/labelling.md, taken with the real page in headless Chromium.

    python tools/label_screenshots.py [--out docs/img] [--chromium /usr/bin/chromium]

Starts ``alpacafarm label serve`` on the bundled demo pairs in a temporary folder, enters a name, labels two pairs
with the keyboard, types a reason and photographs the name screen, a pair and the end screen (PNG, 1200 px wide).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "plugins" / "alpacafarm_validation" / "data" / "label_demo_pairs.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = subprocess.Popen([sys.executable, "-m", "alpacafarm", "label", "serve", str(DEMO), "--pairs", "3",
                                   "--dir", folder, "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            url = next(line.split()[1] for line in server.stdout if line.startswith("open http"))  # type: ignore[union-attr]
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=args.chromium,
                                                     args=["--no-sandbox"] if os.geteuid() == 0 else [])
                page = browser.new_page(viewport={"width": 1200, "height": 210})
                page.goto(url)
                page.fill("#name", "ana")
                page.screenshot(path=str(args.out / "label_name.png"))
                page.set_viewport_size({"width": 1200, "height": 520})
                page.keyboard.press("Enter")
                expect(page.locator("#task")).to_be_visible()
                page.keyboard.press("2")
                expect(page.locator("#count")).to_have_text("1 of 3 labelled")
                expect(page.locator("body")).to_have_attribute("data-state", "ready")
                page.fill("#reason", "both are right; the second says it in one sentence")
                page.screenshot(path=str(args.out / "label_pair.png"))
                page.locator("#reason").press("Escape")
                for key in ("1", "t"):
                    page.keyboard.press(key)
                    expect(page.locator("body")).to_have_attribute("data-state", "ready")
                expect(page.locator("#done")).to_be_visible()
                page.set_viewport_size({"width": 1200, "height": 200})
                page.screenshot(path=str(args.out / "label_done.png"))
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {args.out}/label_name.png, label_pair.png, label_done.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
