"""The chat page in a real headless Chromium (Playwright driving Debian's /usr/bin/chromium).

CI installs the browser with `apt-get install chromium` (.ci/run) and Playwright from PyPI (the
`test` extra); Playwright's own browser download is not used. The test skips, saying why, only
when either is missing. It takes a screenshot of the page; with ``CHATPIPE_SCREENSHOT=docs/chat-ui.png``
it refreshes the README's one, otherwise it writes to a temp dir and leaves the tracked file alone.
"""

from __future__ import annotations

import os
import shutil

import pytest

from chatpipe.model.loading import load_chat_model
from chatpipe.serve.app import create_app
from chatpipe.testing.chatmodel import Paced, make_artifacts, run_in_thread, serve_settings
from tests.conftest import REPO

# as root, with no network: no sandbox, and none of the background calls home that would fail
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e '.[test]')")


def chromium_path() -> str:
    path = os.environ.get("CHATPIPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium executable (apt-get install chromium, or set CHATPIPE_CHROMIUM)")
    return path


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")
    loaded.model.forward = Paced(loaded.model.forward, 0.02)  # a real model's pace: tokens arrive over ~1 s
    cfg = serve_settings(batch_rows=2, max_tokens=48, temperature=0.8, top_k=20)
    server, base = run_in_thread(create_app(loaded, cfg))
    yield base
    server.should_exit = True


@pytest.fixture(scope="module")
def page():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 900, "height": 640})
        yield page
        browser.close()


# Records every text the last assistant bubble shows, so the test sees tokens arrive one by one.
WATCH = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const b = document.querySelectorAll('.msg.assistant');
    if (b.length) window.seen.push(b[b.length - 1].textContent);
  }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
}"""


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant:not([data-streaming])", timeout=30_000)
    page.wait_for_function("!document.getElementById('send').disabled")


def test_chat_page_streams_regenerates_and_starts_a_new_chat(url, page, tmp_path):
    page.goto(url)
    page.wait_for_function("document.getElementById('model').textContent.includes('stage sft')")
    assert "model sft" in page.inner_text("#model")
    page.evaluate(WATCH)

    send(page, "Hello! Who lives in Stonebridge?")
    reply = page.locator(".msg.assistant").last.inner_text()
    seen = [s for s in page.evaluate("window.seen") if s]
    assert len(reply) > 20
    assert len(set(seen)) > 3 and all(reply.startswith(s) for s in seen)  # grew piece by piece: streamed

    page.click("#regen")  # the last reply is replaced by a fresh sample
    page.wait_for_selector(".msg.assistant:not([data-streaming])")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert page.locator(".msg.assistant").count() == 1 and page.locator(".msg.user").count() == 1

    send(page, "And what does a cow say?")
    assert page.locator(".msg.user").count() == 2 and page.locator(".msg.assistant").count() == 2
    screenshot = REPO / os.environ.get("CHATPIPE_SCREENSHOT", tmp_path / "chat-ui.png")
    page.screenshot(path=str(screenshot))
    assert screenshot.stat().st_size > 10_000

    page.click("#new")
    assert page.locator(".msg").count() == 0 and page.locator(".empty").is_visible()
    send(page, "Hi again")  # the new chat starts from an empty conversation
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 1


def test_refused_message_shows_the_servers_error(url, page):
    page.goto(url)
    page.wait_for_function("document.getElementById('model').textContent.includes('stage sft')")
    page.evaluate("document.getElementById('input').removeAttribute('maxlength')")
    page.fill("#input", "x" * 5000)
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.error")
    assert "413" in page.inner_text(".msg.error") and "max_message_chars" in page.inner_text(".msg.error")
