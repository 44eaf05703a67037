"""The dashboard in a real headless browser (Playwright driving Debian's chromium) against a
real `diloco server` process with two real `diloco worker` processes: the login refuses a
wrong token and a token that is not an admin's, then shows both live workers, follows the
rounds as they commit, and evicts a worker from a click (audited as the admin's). A stale
session cookie gets the login page again.

`DILOCO_SCREENSHOTS=docs` also writes docs/dashboard.png and docs/dashboard-login.png.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from diloco.worker import DiLoCoClient, RetryPolicy
from processes import start_worker

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ADMIN = "admin-token-0123456789"
ENROLL = "enroll-token-0123456789"
DOCS = Path(__file__).resolve().parents[2] / "docs"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update",
         "--disable-sync"]  # fmt: skip


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (`make test` installs it)")
def test_the_dashboard_logs_in_follows_a_live_run_and_evicts_from_a_click(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin\n{ENROLL} enroll\n")
    # Heartbeats (which carry each worker's loss) every second: the loss chart fills quickly.
    server = server_process("--sync-every", "4", "--tokens-file", str(tokens),
                            "--heartbeat-interval", "1", "--heartbeat-timeout", "10")  # fmt: skip
    env = {"DILOCO_TOKEN": ENROLL}
    for worker in ("w0", "w1"):
        start_worker(server.url, worker, 0, 1, 100_000, corpus_file, tmp_path, env=env)
    screenshots = os.environ.get("DILOCO_SCREENSHOTS") == "docs"

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        page.goto(server.url + "/")
        page.get_by_label("Admin token").fill("not-the-token")
        page.get_by_role("button", name="Sign in").click()
        assert page.get_by_role("alert").inner_text() == "Wrong token."
        page.get_by_label("Admin token").fill(ENROLL)
        page.get_by_role("button", name="Sign in").click()
        assert "needs an admin token" in page.get_by_role("alert").inner_text()
        assert ENROLL not in page.url and "token" not in page.url
        if screenshots:
            page.screenshot(path=str(DOCS / "dashboard-login.png"))

        page.get_by_label("Admin token").fill(ADMIN)
        page.get_by_role("button", name="Sign in").click()

        # (Locators and Python-side polling only: the page's CSP forbids the eval that
        # Playwright's wait_for_function would use, which is the point of having one.)
        def wait_until(check, what: str) -> None:
            for _ in range(300):
                if check():
                    return
                page.wait_for_timeout(200)
            raise AssertionError(f"the dashboard never showed {what}")

        def shown_round() -> int:
            return int(page.locator("body").get_attribute("data-round") or -1)

        page.locator("#workers tbody tr:not(.gone)").nth(1).wait_for()
        wait_until(lambda: shown_round() >= 2, "round 2")
        seen = shown_round()
        # Live: the round it shows moves on while the page stays open.
        wait_until(lambda: shown_round() > seen, "a round after the first one it showed")
        rows = page.locator("#workers tbody tr")
        assert sorted(rows.nth(i).get_attribute("data-worker") for i in range(rows.count())) == [
            "w0",
            "w1",
        ]
        page.locator("#rounds tbody tr").first.wait_for()
        loss_series = page.locator("#chart-loss .u-series")
        wait_until(lambda: loss_series.count() >= 3, "a loss series per worker")
        if screenshots:
            page.wait_for_timeout(12_000)  # more rounds and losses on the charts
            page.screenshot(path=str(DOCS / "dashboard.png"), full_page=True)

        page.once("dialog", lambda dialog: dialog.accept())
        page.locator('#workers tr[data-worker="w1"] button.evict').click()
        page.get_by_text("evict w1: done").wait_for()
        with DiLoCoClient(server.url, ADMIN, retry=RetryPolicy(attempts=3)) as client:
            audit = client._json_call("audit", "GET", "/v1/admin/audit")["events"]
        (evicted,) = [e for e in audit if e["event"] == "admin_evicted"]
        assert evicted["worker_id"] == "w1" and evicted["detail"]["by"] == "admin"

        # A session the server does not know (expired, or from before a restart): the login.
        page.context.add_cookies([{"name": "diloco_session", "value": "stale", "url": server.url}])
        page.goto(server.url + "/")
        page.get_by_label("Admin token").wait_for()
        assert "Traceback" not in page.content()
        browser.close()
