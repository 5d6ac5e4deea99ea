"""The ops page (GET /admin) in a real browser: Debian's Chromium driven by
Playwright, against a real `mlxd serve` (gateway, worker, ZeroMQ, MLX)."""

import os
import signal

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.conftest import MODEL_NAME, running, wait_for

CHROMIUM = "/usr/bin/chromium"
# Chromium as root in a container, offline: no sandbox, no calls home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "sk-ops-page-test"
SEEN_S = 15_000  # ms: the page reads its state every 2 s


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "ops.log"
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--heartbeat-s", "0.1"],
                 log) as srv:
        yield srv


@pytest.fixture
def page(browser, served):
    context = browser.new_context()
    opened = context.new_page()
    opened.goto(served.url + "/admin")
    yield opened
    context.close()


def model_row(page: Page):
    return page.locator(f'#models tr[data-model="{MODEL_NAME}"]')


def worker_state(page: Page, pid: int):
    return page.locator(f'#workers tr[data-pid="{pid}"] .state')


def complete(server, prompt: str = "Once upon a time", max_tokens: int = 16) -> dict:
    response = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt,
                                                          "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_shows_the_model_and_its_worker_and_follows_a_request(page, served):
    pid = served.health()["worker"]["pid"]
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
    expect(worker_state(page, pid)).to_have_text("ready", timeout=SEEN_S)
    steps = page.locator(f'#workers tr[data-pid="{pid}"] .steps')
    before = int(steps.inner_text())
    complete(served, max_tokens=24)
    page.wait_for_function(f"""() => Number(document.querySelector('#workers tr[data-pid="{pid}"] .steps')
                                            .textContent) >= {before + 24}""", timeout=SEEN_S)
    expect(page.locator("#now-tokens")).not_to_have_text("–", timeout=SEEN_S)
    expect(page.locator("#events")).to_contain_text("ready")
    # Each event names its model, and a long reason (a load failure's) wraps instead of widening the page.
    expect(page.locator("#events tbody tr td").nth(1)).to_have_text(MODEL_NAME)
    assert page.locator("#events tbody td.why").first.evaluate("td => getComputedStyle(td).whiteSpace") == "normal"


def test_a_server_that_stops_answering_for_a_while_is_said_so_and_then_not(page, served):
    """The banner stayed for as long as the tab was open, over a dashboard
    drawn again from fresh state; a click while the server did not answer
    said nothing at all."""
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
    page.route("**/admin/**", lambda route: route.abort())
    expect(page.locator("#error")).to_contain_text("the server does not answer", timeout=SEEN_S)
    page.evaluate("document.getElementById('error').textContent = ''")
    page.once("dialog", lambda dialog: dialog.accept())
    model_row(page).locator('button[data-action="pin"]').click()
    expect(page.locator("#error")).to_have_text("the server does not answer", timeout=SEEN_S)
    page.unroute("**/admin/**")
    expect(page.locator("#error")).to_have_text("", timeout=SEEN_S)
    assert served.health()["pool"]["models"][MODEL_NAME]["pinned"] is False


def test_a_server_that_answers_nothing_is_said_so_with_the_age_of_the_figures(page, served):
    """A hung gateway, or a connection the network dropped, fails no fetch: the page went on showing its
    last figures as live, with no word."""
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
    page.route("**/admin/state", lambda route: None)  # never answered
    expect(page.locator("#error")).to_contain_text("the server does not answer · the figures below are from",
                                                   timeout=SEEN_S)
    page.unroute("**/admin/state")
    expect(page.locator("#error")).to_have_text("", timeout=SEEN_S)


def test_a_killed_worker_shows_as_lost_then_its_successor_as_ready(page, served):
    pid = served.health()["worker"]["pid"]
    expect(worker_state(page, pid)).to_have_text("ready", timeout=SEEN_S)
    os.kill(pid, signal.SIGKILL)
    expect(worker_state(page, pid)).to_have_text("lost", timeout=SEEN_S)
    # Its served name, as its model's row and its live row say it: it read as the model's path.
    expect(page.locator(f'#workers tr[data-pid="{pid}"] td').nth(1)).to_have_text(MODEL_NAME)
    served.wait_ready()
    successor = served.health()["worker"]["pid"]
    assert successor != pid
    expect(worker_state(page, successor)).to_have_text("ready", timeout=SEEN_S)
    expect(page.locator("#events")).to_contain_text("lost")
    assert complete(served)["choices"][0]["text"]


def test_a_frozen_worker_shows_on_its_models_row(page, served):
    """The model's row said "loading" for a loaded model whose worker stopped answering."""
    pid = served.health()["worker"]["pid"]
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
    os.kill(pid, signal.SIGSTOP)
    try:
        expect(model_row(page).locator(".state")).to_have_text("unresponsive", timeout=SEEN_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
    assert served.health()["pool"]["models"][MODEL_NAME]["crash_loop"] is False


def test_unload_asks_first_and_unloads_once_confirmed(page, served):
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
    page.once("dialog", lambda dialog: dialog.dismiss())
    model_row(page).locator('button[data-action="unload"]').click()
    page.wait_for_timeout(3000)
    assert served.health()["pool"]["models"][MODEL_NAME]["status"] == "loaded"

    page.once("dialog", lambda dialog: dialog.accept())
    model_row(page).locator('button[data-action="unload"]').click()
    expect(model_row(page).locator(".state")).to_have_text("unloaded", timeout=SEEN_S)
    assert served.health()["pool"]["models"][MODEL_NAME]["status"] == "unloaded"

    page.once("dialog", lambda dialog: dialog.accept())
    model_row(page).locator('button[data-action="load"]').click()
    expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=60_000)


def test_pin_and_restart_from_the_page(page, served):
    expect(model_row(page).locator(".pinned")).to_have_text("no", timeout=SEEN_S)
    page.once("dialog", lambda dialog: dialog.accept())
    model_row(page).locator('button[data-action="pin"]').click()
    expect(model_row(page).locator(".pinned")).to_have_text("yes", timeout=SEEN_S)
    assert served.health()["pool"]["models"][MODEL_NAME]["pinned"] is True
    page.once("dialog", lambda dialog: dialog.accept())
    model_row(page).locator('button[data-action="unpin"]').click()
    expect(model_row(page).locator(".pinned")).to_have_text("no", timeout=SEEN_S)

    pid = served.health()["worker"]["pid"]
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(f'#workers tr[data-pid="{pid}"] button[data-action="restart"]').click()
    wait_for(lambda: served.health()["worker"].get("pid") not in (None, pid) and served.health()["worker"]["ready"],
             60, "the restarted worker")
    assert served.health()["supervisor"]["crash_loop"] is False
    assert complete(served)["choices"][0]["text"]


def test_the_log_tail_holds_no_prompt(served):
    complete(served, prompt="a very distinctive prompt: zebra quartz")
    answer = served.http.get("/admin/state")
    assert answer.json()["log"] and "zebra" not in str(answer.json()["log"])
    # Nor kept in a browser's cache, where /admin/state was opened without keys.
    assert answer.headers["cache-control"] == "no-store" and answer.headers["x-content-type-options"] == "nosniff"


def test_an_action_from_another_origin_is_refused(served):
    path = f"/admin/models/{MODEL_NAME}/pin"
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "null"}):
        response = served.http.post(path, headers=headers)
        assert response.status_code == 403 and response.json()["error"]["code"] == "cross_site_request"
    assert served.health()["pool"]["models"][MODEL_NAME]["pinned"] is False
    same_origin = {"Origin": served.url, "Sec-Fetch-Site": "same-origin"}
    assert served.http.post(f"/admin/models/{MODEL_NAME}/unpin", headers=same_origin).status_code == 200
    assert served.http.post("/admin/workers/1/restart").status_code == 404


def test_with_keys_the_page_shows_nothing_without_one(browser, tiny_model, tmp_path):
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--api-key", KEY],
                 tmp_path / "keys.log") as srv:
        assert httpx.get(srv.url + "/admin/state").status_code == 401
        context = browser.new_context()
        page = context.new_page()
        page.goto(srv.url + "/admin")
        expect(page.locator("#key-form")).to_be_visible(timeout=SEEN_S)
        expect(page.locator("#dashboard")).to_be_hidden()
        assert MODEL_NAME not in page.locator("body").inner_text()

        page.fill("#key", "not-the-key")
        page.click("#key-form button")
        expect(page.locator("#error")).to_have_text("that key was not accepted", timeout=SEEN_S)
        expect(page.locator("#dashboard")).to_be_hidden()

        # A header holds none of these: every poll failed as "the server does not answer", the form hidden.
        for pasted in (KEY + "\u201d", KEY + "\u200b"):
            page.fill("#key", pasted)
            page.click("#key-form button")
            expect(page.locator("#error")).to_contain_text("holds characters no request can carry", timeout=SEEN_S)
            expect(page.locator("#key-form")).to_be_visible()

        page.fill("#key", KEY)
        page.click("#key-form button")
        expect(model_row(page).locator(".state")).to_have_text("loaded", timeout=SEEN_S)
        context.close()
