"""The labelling page in a real browser: headless Chromium (the system's, Debian package ``chromium``) driven by
Playwright (issues 39 and 62): keyboard labelling, reload and resume, answers with markup shown as text, two
labellers, invite links, undo, "both bad", a closed tab releasing its pair, markdown answers, sticky buttons and
guidelines."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from label_session import call, invite, next_pair, plain_pairs, serving, write_pairs

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


def count(labelled: int, skipped: int, left: int) -> str:
    return f"{labelled} labelled · {skipped} skipped · {left} left for you"


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
        expect(page.locator("#count")).to_have_text(count(0, 0, 6))
        done = [press(page, "1", count(1, 0, 5))]
        page.fill("#reason", "clearer")  # keys typed in the reason box are text, not choices
        expect(page.locator("#count")).to_have_text(count(1, 0, 5))
        page.locator("#reason").press("Escape")
        done.append(press(page, "2", count(2, 0, 4)))
        current = page.locator("#task").get_attribute("data-pair-id")
        page.reload()  # mid-way: the same person, the same pair, nothing lost
        expect(page.locator("#who-name")).to_have_text("ann")
        expect(page.locator("#count")).to_have_text(count(2, 0, 4))
        assert page.locator("#task").get_attribute("data-pair-id") == current
        done.append(press(page, "t", count(3, 0, 3)))
        done.append(press(page, "s", count(3, 1, 2)))  # a skip is counted apart
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


def test_an_invite_link_signs_in_and_undo_takes_back_a_misclick(browser, tmp_path: Path) -> None:
    """Issue 62 (1, 3, 9): no name to type with a link; u undoes the last label (kept in the history); b is
    "both bad"."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(3))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder)) as (url, _):
        token = invite(folder, "Ann Lee", url)
        page = browser.new_page()
        page.goto(f"{url}?token={token}")
        expect(page.locator("#task")).to_be_visible()
        expect(page.locator("#who-name")).to_have_text("Ann Lee")
        assert page.locator("#login").is_hidden() and page.locator("#switch").is_hidden()
        first = press(page, "1", count(1, 0, 2))
        page.keyboard.press("u")
        expect(page.locator("#count")).to_have_text(count(0, 0, 3))
        expect(page.locator("#note")).to_contain_text("first is better")
        assert page.locator("#task").get_attribute("data-pair-id") == first
        press(page, "2", count(1, 0, 2))
        press(page, "b", count(2, 0, 1))
        page.click("button[data-choice=tie]")
        expect(page.locator("#done")).to_be_visible()
        stored = labels(folder)
        assert [(r[0], r[2]) for r in stored] == [("Ann Lee", "second"), ("Ann Lee", "both_bad"), ("Ann Lee", "tie")]
        assert stored[0][1] == first
        with sqlite3.connect(folder / "labels.sqlite") as db:
            assert [r[0] for r in db.execute("SELECT action FROM label_events ORDER BY id")] == [
                "label", "undo", "label", "label", "label"]
        page.close()


def test_a_closed_tab_releases_its_pair(browser, tmp_path: Path) -> None:
    """Issue 62 (5): a page that was opened and left frees its pair for the others at once."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(1))
    with serving(str(pairs), "--dir", str(tmp_path / "session"), "--overlap", "0") as (url, _):
        page = browser.new_page()
        log_in(page, url, "ann")
        assert next_pair(url, "bob")[1]["done"] is True  # ann's page holds the only pair
        page.goto("about:blank")  # ann leaves (closing the tab fires the same pagehide)
        for _ in range(50):
            status, served = next_pair(url, "bob")
            if not served["done"]:
                break
            page.wait_for_timeout(100)
        assert status == 200 and served["done"] is False
        page.close()


def test_answers_render_as_markdown_with_the_buttons_in_view(browser, tmp_path: Path) -> None:
    """Issue 62 (6, 9): code blocks (fixed-width) and tables render, HTML in them stays text; however long the
    pair, the choice buttons stay on screen; guidelines from a file are shown."""
    table = "| name | value |\n|---|---|\n| <b>x</b> | `1` |"
    code = "Use this:\n\n```python\nprint('<img src=x onerror=alert(1)>')\n```\n\n**done**"
    long = "\n\n".join(f"Paragraph {i} of a long instruction." for i in range(60))
    pairs = write_pairs(tmp_path / "pairs.jsonl", [{"instruction": long, "output_1": table, "output_2": code}])
    guidelines = tmp_path / "guidelines.md"
    guidelines.write_text("Prefer **correct** answers.\n\n- facts first\n- then clarity\n", encoding="utf-8")
    with serving(str(pairs), "--dir", str(tmp_path / "session"), "--guidelines", str(guidelines)) as (url, _):
        page = browser.new_page(viewport={"width": 900, "height": 600})
        log_in(page, url, "ann")
        answers = page.locator(".answers")
        expect(answers.locator("table td")).to_have_count(2)
        assert answers.locator("table td").first.inner_text() == "<b>x</b>"
        code_block = answers.locator("pre code")
        expect(code_block).to_have_text("print('<img src=x onerror=alert(1)>')")
        assert "mono" in code_block.evaluate("e => getComputedStyle(e).fontFamily").lower()
        assert answers.locator("strong").inner_text() == "done"
        assert page.locator("#task img, #task script, #task b, #task iframe").count() == 0
        box = page.locator("button[data-choice=first]").bounding_box()
        assert box is not None and box["y"] + box["height"] <= 600, box  # on screen without scrolling
        expect(page.locator("#guidelines li")).to_have_count(2)
        assert page.locator("#guidelines strong").text_content() == "correct"  # folded away until opened
        assert call(url, "/api/session")[1]["guidelines"].startswith("Prefer")
        page.close()
