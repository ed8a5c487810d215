"""The labelling page in a real browser: headless Chromium (the system's, Debian package ``chromium``) driven by
Playwright (issue 39): keyboard labelling, reload and resume, answers with markup shown as text, two labellers."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from label_session import plain_pairs, serving, write_pairs

CHROMIUM = os.environ.get("ALPACAFARM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (as .ci/run does)", allow_module_level=True)

expect = playwright_api.expect


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless Chromium for the module (a launch costs ~2 s); each test opens its own contexts."""
    with playwright_api.sync_playwright() as playwright:
        # root (CI containers) cannot use Chromium's sandbox
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        yield browser
        browser.close()


def labels(folder: Path) -> list[tuple[str, str, str, str]]:
    with sqlite3.connect(folder / "labels.sqlite") as db:
        return db.execute("SELECT labeller, pair_id, choice, reason FROM labels ORDER BY created").fetchall()


def log_in(page, url: str, name: str) -> None:
    page.goto(url)
    page.fill("#name", name)
    page.keyboard.press("Enter")
    expect(page.locator("#task")).to_be_visible()


def press(page, key: str, count_after: str) -> str:
    """Press ``key`` on the current pair; returns the pair's id once the page shows the next one, ready."""
    shown = page.locator("#task").get_attribute("data-pair-id")
    page.keyboard.press(key)
    expect(page.locator("#count")).to_have_text(count_after)
    expect(page.locator("body")).to_have_attribute("data-state", "ready")
    return shown


def test_keyboard_labelling_survives_a_reload(browser, tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(6))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder)) as (url, _):
        page = browser.new_page()
        log_in(page, url, "ann")
        expect(page.locator("#count")).to_have_text("0 of 6 labelled")
        done = [press(page, "1", "1 of 6 labelled")]
        page.fill("#reason", "clearer")  # keys typed in the reason box are text, not choices
        expect(page.locator("#count")).to_have_text("1 of 6 labelled")
        page.locator("#reason").press("Escape")
        done.append(press(page, "2", "2 of 6 labelled"))
        current = page.locator("#task").get_attribute("data-pair-id")
        page.reload()  # mid-way: the same person, the same pair, nothing lost
        expect(page.locator("#who-name")).to_have_text("ann")
        expect(page.locator("#count")).to_have_text("2 of 6 labelled")
        assert page.locator("#task").get_attribute("data-pair-id") == current
        done.append(press(page, "t", "3 of 6 labelled"))
        done.append(press(page, "s", "4 of 6 labelled"))
        page.click("button[data-choice=first]")
        page.click("button[data-choice=second]")
        expect(page.locator("#done")).to_be_visible()
        stored = labels(folder)
        assert [r[2] for r in stored] == ["first", "second", "tie", "skip", "first", "second"]
        assert [r[1] for r in stored[:4]] == done and len({r[1] for r in stored}) == 6
        assert stored[1][3] == "clearer"
        page.close()


def test_answers_with_markup_show_as_characters(browser, tmp_path: Path) -> None:
    script = "<script>window.pwned = 'script'</script>"
    image = "<img src=x onerror=\"window.pwned = 'img'\">"
    rows = [{"instruction": "<b>Bold?</b>", "input": "<iframe src='/api/next'></iframe>", "output_1": script,
             "output_2": image}]
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    with serving(str(pairs), "--dir", str(tmp_path / "session")) as (url, _):
        page = browser.new_page()
        log_in(page, url, "ann")
        answers = {page.locator("#first").inner_text(), page.locator("#second").inner_text()}
        assert answers == {script, image}
        assert page.locator("#instruction").inner_text() == "<b>Bold?</b>"
        assert page.locator("#input").inner_text() == "<iframe src='/api/next'></iframe>"
        assert page.locator("#task img, #task script, #task b, #task iframe").count() == 0
        assert page.evaluate("() => window.pwned") is None
        page.close()


def test_two_labellers_at_once(browser, tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(6))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder), "--overlap", "0.3") as (url, _):
        contexts = [browser.new_context(), browser.new_context()]  # two people: separate storage
        pages = [context.new_page() for context in contexts]
        for page, name in zip(pages, ("ann", "bob"), strict=True):
            log_in(page, url, name)
        while any(p.locator("#task").is_visible() for p in pages):
            for page in pages:  # turn by turn, both sessions open at once
                if page.locator("#task").is_visible():
                    before = page.locator("#count").inner_text()
                    page.keyboard.press("1")
                    expect(page.locator("#count")).not_to_have_text(before)
                    expect(page.locator("body")).to_have_attribute("data-state", "ready")
        stored = labels(folder)
        by_person = {name: {r[1] for r in stored if r[0] == name} for name in ("ann", "bob")}
        assert len(stored) == sum(map(len, by_person.values()))  # no one labelled a pair twice
        shared = by_person["ann"] & by_person["bob"]
        assert len(shared) == 2  # ceil(0.3 * 6) overlap pairs, shown to both; the 4 others to one of them
        assert len(by_person["ann"] | by_person["bob"]) == 6 and len(stored) == 8
        for context in contexts:
            context.close()
