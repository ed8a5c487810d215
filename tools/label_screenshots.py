"""Screenshots of the labelling page for docs/labelling.md, taken with the real page in headless Chromium.

    python tools/label_screenshots.py [--out docs/img] [--chromium /usr/bin/chromium]

Two sessions on the bundled demo pairs, in temporary folders. Without invites: the name screen. Then a team of
three with invite links (``alpacafarm label invite``): each labels from their own link, one undoes a mis-click;
photographed are a pair being labelled (with the reason box), the note an undo leaves, the team page and the end
screen (PNG, 1200 px wide).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "plugins" / "alpacafarm_validation" / "data" / "label_demo_pairs.jsonl"


def serve(folder: str) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([sys.executable, "-m", "alpacafarm", "label", "serve", str(DEMO), "--pairs", "4",
                               "--dir", folder, "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    url = next(line.split()[1] for line in server.stdout if line.startswith("open http"))  # type: ignore[union-attr]
    return server, url


def invite(folder: str, name: str, url: str) -> str:
    out = subprocess.run([sys.executable, "-m", "alpacafarm", "label", "invite", name, "--dir", folder, "--url", url],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    return json.loads(out)["link"]


def ready(page) -> None:
    expect(page.locator("body")).to_have_attribute("data-state", "ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as alone, tempfile.TemporaryDirectory() as team, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"] if os.geteuid() == 0 else [])
        server, url = serve(alone)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 230})
            page.goto(url)
            page.fill("#name", "ana")
            page.screenshot(path=str(args.out / "label_name.png"))
            page.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
        server, url = serve(team)
        try:
            links = {name: invite(team, name, url) for name in ("ana", "ben", "cai")}
            pages = {}
            for name, link in links.items():
                pages[name] = browser.new_context().new_page()
                pages[name].set_viewport_size({"width": 1200, "height": 620})
                pages[name].goto(link)
                expect(pages[name].locator("#task")).to_be_visible()
            ana = pages["ana"]
            ana.keyboard.press("1")
            ready(ana)
            ana.keyboard.press("u")  # a mis-click: the pair comes back
            expect(ana.locator("#note")).to_be_visible()
            ana.screenshot(path=str(args.out / "label_undo.png"))
            ana.keyboard.press("2")
            ready(ana)
            ana.fill("#reason", "both are right; the second says it in one sentence")
            ana.screenshot(path=str(args.out / "label_pair.png"))
            ana.locator("#reason").press("Escape")
            for name, keys in (("ana", "1t2"), ("ben", "12b2"), ("cai", "2s1")):
                for key in keys:
                    pages[name].keyboard.press(key)
                    ready(pages[name])
            expect(ana.locator("#done")).to_be_visible()
            ana.set_viewport_size({"width": 1200, "height": 200})
            ana.screenshot(path=str(args.out / "label_done.png"))
            board = browser.new_page(viewport={"width": 1200, "height": 420})
            board.goto(links["ben"].replace("/?token=", "/team?token="))
            board.screenshot(path=str(args.out / "label_team.png"))
        finally:
            server.terminate()
            server.wait(timeout=30)
        browser.close()
    print(f"wrote {args.out}/label_name.png, label_pair.png, label_undo.png, label_team.png, label_done.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
