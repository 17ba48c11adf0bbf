"""`swarmctl serve`'s web page (issue 35 item 4), in a real headless browser: Debian's chromium
driven through chromium-driver by Selenium, against a real `swarmctl serve` process with an API key.

A question typed into the page gets the same answer as the official client's request to the API;
the page's swarm view shows what each node holds; nothing, the page included, is served without
the key (the browser sends it as HTTP Basic). Skipped, saying why, where chromium or its driver is
not installed (.ci/run installs them)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

API_KEY = "web-page-test-key"
QUESTION = "Name the three primary colours."
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("web")
    env = {**os.environ, "SWARMCTL_HOME": str(home / "home")}
    process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--transport", "inproc", "--port", "0",
                                "--threads", "1", "--api-key", API_KEY, "--ui"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = process.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, f"serve did not start: {line!r}"
        yield match[1]
    finally:
        process.terminate()
        process.wait(30)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_nothing_is_served_without_the_key_not_even_the_page(served):
    status, headers, _ = _get(served + "/", {"Accept": "text/html"})
    assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Basic")
    basic = "Basic " + base64.b64encode(f"me:{API_KEY}".encode()).decode()
    status, headers, page = _get(served + "/", {"Accept": "text/html", "Authorization": basic})
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"/v1/chat/completions" in page
    assert b"http://" not in page and b"https://" not in page  # no CDN: the page is all there is
    status, _, body = _get(served + "/v1/swarm", {"Authorization": f"Bearer {API_KEY}"})
    swarm = json.loads(body)
    assert status == 200 and swarm["nodes"] and all(n["holds"].startswith("layers [") for n in swarm["nodes"])
    status, _, _ = _get(served + "/v1/swarm", {"Authorization": "Basic " + base64.b64encode(b"me:wrong").decode()})
    assert status == 401


@pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason="chromium and chromium-driver are not installed "
                                                                "(apt-get install chromium chromium-driver)")
def test_a_question_typed_into_the_page_gets_the_apis_answer(served, tmp_path):
    import openai
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    client = openai.OpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    want = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=256).choices[0].message.content

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,720"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    try:
        # What a person's browser does after they typed the key into its Basic prompt: every request
        # to this origin, the page's own fetches included, carries it (set here through DevTools).
        basic = "Basic " + base64.b64encode(f"me:{API_KEY}".encode()).decode()
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": basic}})
        driver.get(served + "/")
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-swarm") == "shown")
        rows = driver.find_elements(By.CSS_SELECTOR, "#swarm tbody tr")
        assert rows and all("layers [" in r.text for r in rows)
        temperature = driver.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        driver.find_element(By.ID, "question").send_keys(QUESTION)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='yes'], "
                                                              ".assistant[data-done='error']"))
        answer = driver.find_element(By.CSS_SELECTOR, ".assistant")
        assert answer.get_attribute("data-done") == "yes", answer.text
        assert answer.get_attribute("textContent") == want
        shot = tmp_path / "page.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("SWARMCTL_UI_SCREENSHOT"):  # (docs/ui.png is made this way)
            shutil.copy(shot, Path(os.environ["SWARMCTL_UI_SCREENSHOT"]))
    finally:
        driver.quit()
