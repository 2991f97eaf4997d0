"""The built site in headless Chromium, served over loopback as a user's browser would load it:
the navigation lists every page and takes the user to one, and search finds pages."""

import asyncio
import functools
import re
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.cdp import Browser, NavigatedAway, chromium
from tests.docs.conftest import ROOT

pytestmark = pytest.mark.skipif(chromium() is None, reason=(
    "no chromium/chromium-browser/google-chrome on PATH (make install-test installs Debian's "
    "chromium where apt-get is available)"))


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(built_site):
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(QuietHandler, directory=str(built_site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def nav_titles() -> list[str]:
    return re.findall(r"^\s+- ([^:\n]+): \S+\.md$", (ROOT / "mkdocs.yml").read_text(), re.M)


async def navigate_and_search(base: str, profile) -> dict:
    seen = {}
    async with Browser(profile) as page:
        await page.goto(f"{base}/index.html")
        seen["links"] = await page.js(
            "Array.from(document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]'))"
            ".map(a => [a.textContent.trim(), a.href])")
        # follow the sidebar to a guide, as a click
        try:
            await page.js("Array.from(document.querySelectorAll('nav.md-nav--primary a'))"
                          ".find(a => a.textContent.trim() === 'Batch files and formats').click()")
        except NavigatedAway:  # the click's page load overtook the evaluation's answer
            pass
        seen["landed"] = await page.wait_for(
            "location.pathname.endsWith('/guides/batch-files.html') && "
            "document.querySelector('h1') && document.querySelector('h1').textContent")
        # search from that page: type a word, wait for the worker's results
        await page.js("(() => { const box = document.querySelector('.md-search__input');"
                      " box.focus(); box.value = 'resume';"
                      " box.dispatchEvent(new Event('input', {bubbles: true}));"
                      " box.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true})); })()")
        await page.wait_for("document.querySelectorAll('.md-search-result__item').length > 0")
        seen["results"] = await page.js(
            "Array.from(document.querySelectorAll('.md-search-result__item a'))"
            ".map(a => a.href)")
        seen["meta"] = await page.js(
            "document.querySelector('.md-search-result__meta').textContent")
    return seen


def test_navigation_reaches_every_page_and_search_finds_pages(served, tmp_path):
    seen = asyncio.run(navigate_and_search(served, tmp_path / "profile"))
    titles = [t for t, _ in seen["links"]]
    for title in nav_titles():
        assert title in titles, f"{title} is not in the sidebar"
    for title, href in seen["links"]:
        with urllib.request.urlopen(href.split("#")[0]) as answer:
            assert answer.status == 200, (title, href)
    assert seen["landed"].strip().startswith("Batch files and formats")
    assert re.match(r"\d+ matching documents?", seen["meta"]), seen["meta"]
    assert any("/guides/storage-and-resume.html" in href for href in seen["results"]), \
        seen["results"][:10]
