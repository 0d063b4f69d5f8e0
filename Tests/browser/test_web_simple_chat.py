"""The web Simple Chat (Examples/web) in a real browser: headless Chromium from Debian's
packages, driven by Selenium. alice and bob, each in a browser of their own, exchange
messages over chatcore's WebSocket listener, see Delivered and Read and each other typing,
and a reload keeps the history. A screenshot of each window is saved
($CHATCORE_SCREENSHOTS, default .build/screenshots).

Run by `make test-browser` (and by `make test` when Chromium is installed)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason="Chromium is not installed (make test-browser installs it)")


def binary():
    return os.environ.get("CHATCORE_BINARY") or os.path.join(ROOT, ".build", "debug", "chatcore")


@pytest.fixture
def web(tmp_path):
    """Examples/web/serve.py on a free port; its URL."""
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "Examples", "web", "serve.py"), "--binary", binary(), "--port", "0",
                                "--data-dir", str(tmp_path / "data")],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    found = re.search(r"is at (http://\S+/) ", line)
    assert found, f"the example did not start: {line}"
    yield found.group(1)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,700"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def wait(driver, condition, timeout=20, what="the page"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = condition(driver)
            if value:
                return value
        except Exception:  # an element not there yet, or replaced while read
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout} s; the page says: {driver.find_element('tag name', 'body').text!r}")


def sign_in(driver, url, user):
    driver.get(url)
    driver.find_element("id", "user").send_keys(user)
    driver.find_element("id", "sign-in-button").click()
    wait(driver, lambda d: d.find_element("id", "me").text == user, what=f"{user} signing in")


def messages(driver):
    return [item.text for item in driver.find_elements("css selector", "#messages li.mine, #messages li.theirs")]


def test_two_people_chat_in_two_browsers(web):
    screenshots = os.environ.get("CHATCORE_SCREENSHOTS", os.path.join(ROOT, ".build", "screenshots"))
    os.makedirs(screenshots, exist_ok=True)
    alice, bob = browser(), browser()
    try:
        sign_in(alice, web, "alice")
        sign_in(bob, web, "bob")
        # alice starts a chat with bob and writes; bob's list shows it unread.
        alice.find_element("id", "invitee").send_keys("bob")
        alice.find_element("css selector", "#new-chat button").click()
        wait(alice, lambda d: not d.find_element("id", "composer").get_attribute("hidden"), what="the chat opening")
        alice.find_element("id", "text").send_keys("hello bob")
        alice.find_element("id", "send").click()
        wait(alice, lambda d: any(m.startswith("hello bob") for m in messages(d)), what="alice's message showing")
        wait(alice, lambda d: "Delivered" in messages(d)[-1], what="Delivered (bob is connected)")
        wait(bob, lambda d: d.find_element("css selector", "#chats li .unread").text == "1", what="bob's unread count")
        # bob opens it: he reads it, and alice sees Read.
        bob.find_element("css selector", "#chats li").click()
        wait(bob, lambda d: messages(d) == ["alice: hello bob"], what="bob seeing the message")
        wait(alice, lambda d: messages(d)[-1].endswith("Read"), what="Read")
        wait(bob, lambda d: not d.find_elements("css selector", "#chats li .unread"), what="bob's unread count going")
        # bob types: alice sees it; he sends, and it reaches her.
        bob.find_element("id", "text").send_keys("hi ")
        wait(alice, lambda d: d.find_element("id", "typing").text == "bob is typing…", what="bob typing")
        bob.find_element("id", "text").send_keys("alice")
        bob.find_element("id", "send").click()
        wait(alice, lambda d: "bob: hi alice" in messages(d), what="bob's reply")
        wait(alice, lambda d: d.find_element("id", "typing").text == "", what="typing ending with the message")
        # A reload keeps the history (it is the service's).
        alice.refresh()
        wait(alice, lambda d: d.find_element("id", "me").text == "alice", what="signing in again after a reload")
        alice.find_element("css selector", "#chats li").click()
        wait(alice, lambda d: [m.replace("Read", "").strip() for m in messages(d)] == ["hello bob", "bob: hi alice"], what="the history after a reload")
        alice.save_screenshot(os.path.join(screenshots, "web-simple-chat-alice.png"))
        bob.save_screenshot(os.path.join(screenshots, "web-simple-chat-bob.png"))
        print("screenshots in", screenshots)
        for driver in (alice, bob):
            assert driver.find_element("id", "error").text == "", "the page reported an error"
            logged = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
            assert not logged, logged
    finally:
        alice.quit()
        bob.quit()
