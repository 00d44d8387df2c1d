"""The dashboard in a real headless Chromium (Debian's chromium + chromedriver, through
Selenium) against a real `ciuic serve` process: load, navigate projects -> jobs -> the chain ->
a snapshot, verify a snapshot, screenshot every page; the pages a new user met wrong (issue 42):
a project the key does not open, a job that does not exist, an empty project, a one-snapshot
job, the runs column at 1000, 1400 and 1920 pixels, a server stopped under the page."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, knobs
from tests.test_health import train_with_adam
from tests.test_server import new_key, serve

# the server's address, a reader key of project dash, and other keys by name ("void": a reader
# of project void, which has no job)
Site = tuple[str, str, dict[str, str]]


def chrome(profile: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        raise RuntimeError("Chromium is not installed: run scripts/services.sh (as root), or "
                           "install Debian's chromium and chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=Service(executable_path=driver))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A server holding job dash/train with five snapshots (loss recorded), dash/sick (NaN at
    step 3), dash/adam, dash/rot (one snapshot, every chunk corrupted), dash/gone (its one
    snapshot pruned) and project void with no job."""
    base = tmp_path_factory.mktemp("dash")
    store = base / "store"
    writer = new_key(store, "dash", "writer")
    reader = new_key(store, "dash", "reader")
    admin = new_key(store, "dash", "admin")
    void = new_key(store, "void", "reader")
    with serve(store, base / "server.log") as url:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4))
        with SnapshotManager("dash", job="train", api_key=writer, endpoint=url,
                             save_interval=10, handle_signals=False) as m:
            for step in range(40):
                with torch.no_grad():
                    model[0].weight.mul_(0.99)
                m.step(step, model, loss=2.0 / (step + 1))
        with SnapshotManager("dash", job="sick", api_key=writer, endpoint=url,
                             handle_signals=False) as m:
            for step in (1, 2, 3):
                if step == 3:
                    with torch.no_grad():
                        model[1].bias[2] = float("nan")
                m.save(step, model, loss=1.0 / step)
        # job dash/adam: Adam's per-parameter step counters (float tensors) in the optimizer
        torch.manual_seed(0)
        with SnapshotManager("dash", job="adam", api_key=writer, endpoint=url,
                             handle_signals=False) as m:
            train_with_adam(m, nn.Linear(16, 8), 30, 15)
        # job dash/rot: every chunk of its one snapshot corrupted (its tensors are its own)
        chunks = base / "store" / "objects" / "projects" / "dash" / "chunks"
        before = set(chunks.rglob("*"))
        with knobs.override(pack_bytes=0), SnapshotManager(  # chunk objects, each corrupted
                "dash", job="rot", api_key=writer, endpoint=url, handle_signals=False) as m:
            m.save(1, {"w": torch.randn(3000), "b": torch.randn(70)})
        for path in set(chunks.rglob("*")) - before:
            if path.is_file():
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        with SnapshotManager("dash", job="gone", api_key=writer, endpoint=url,
                             handle_signals=False) as m:
            gone = m.save(1, {"w": torch.zeros(4)})
        pruned = httpx.delete(f"{url}/v1/projects/dash/snapshots/{gone.id}",
                              headers={"Authorization": f"Bearer {admin}"})
        assert pruned.status_code == 200, pruned.text
        yield url, reader, {"void": void}


def wait_ready(driver: Any, route: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == route)


def open_page(driver: Any, url: str, key: str, route: str) -> None:
    """Sign in with ``key`` (the page keeps it), then open ``route`` and wait until it shows."""
    driver.get(f"{url}/#key={key}")
    wait_ready(driver, "/")
    driver.get(f"{url}/#{route}")
    wait_ready(driver, route)


def test_load_navigate_verify_and_screenshot(site: Site, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    shots: list[Path] = []

    def shot(name: str) -> None:
        path = tmp_path / f"{name}.png"
        driver.save_screenshot(str(path))
        shots.append(path)

    try:
        driver.get(f"{url}/#key={key}")
        wait_ready(driver, "/")
        assert "dash" in driver.find_element(By.ID, "projects").text
        assert "reader of dash" in driver.find_element(By.ID, "who").text
        shot("projects")
        driver.find_element(By.LINK_TEXT, "dash").click()
        wait_ready(driver, "/p/dash")
        jobs = driver.find_element(By.ID, "jobs").text
        assert "train" in jobs and "5" in jobs  # steps 0, 10, 20, 30 and the final 39
        # when each job saved last (which one is running): the jobs' page did not say
        cells = driver.find_elements(By.CSS_SELECTOR, '#jobs tr[data-job="train"] td')
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", cells[-1].text), cells[-1].text
        shot("jobs")
        driver.find_element(By.LINK_TEXT, "train").click()
        wait_ready(driver, "/p/dash/j/train")
        rows = driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step]")
        assert [r.get_attribute("data-step") for r in rows] == ["39", "30", "20", "10", "0"]
        assert len(driver.find_elements(By.CSS_SELECTOR, "#chart circle")) == 5
        assert "loss" in driver.find_element(By.ID, "chart").text
        rows[0].find_element(By.CSS_SELECTOR, "button[data-verify]").click()
        WebDriverWait(driver, 30).until(lambda d: "verified" in rows[0].text)
        assert "chunks re-hashed" in rows[0].text  # a reader's check re-hashes (issue 30)
        shot("chain")
        rows[0].find_elements(By.TAG_NAME, "a")[0].click()
        WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.ID, "tensors") or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        table = driver.find_element(By.ID, "tensors").text
        assert "model/0.weight" in table and "float32" in table and "(64, 32)" in table
        assert "step 39" in driver.find_element(By.TAG_NAME, "h2").text
        shot("snapshot")
        # names from the URL are text, never markup (a crafted link cannot run script)
        driver.get(f"{url}/#/p/%22%3E%3Cimg%20id%3Dpwned%20src%3Dx%3E")
        wait_ready(driver, '/p/%22%3E%3Cimg%20id%3Dpwned%20src%3Dx%3E')
        assert not driver.find_elements(By.ID, "pwned")
        assert '"><img' in driver.find_element(By.ID, "crumbs").text
    finally:
        driver.quit()
    for path in shots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_health_plots_and_the_diff_of_two_snapshots(site: Site,
                                                     tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash/j/sick")
        rows = driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step]")
        assert [r.get_attribute("data-step") for r in rows] == ["3", "2", "1"]
        health = [r.find_element(By.CSS_SELECTOR, "td.health").text for r in rows]
        assert health[0].startswith("unhealthy: model/1.bias: 1 NaN") and health[1:] == [
            "healthy", "healthy"]
        assert len(driver.find_elements(By.CSS_SELECTOR, "#chart circle.unhealthy")) == 1
        # step 3's model holds a NaN: its norm is NaN, not a point that looks healthy
        assert len(driver.find_elements(By.CSS_SELECTOR, "#norms circle")) == 2
        # and the page says why the norm's line ends at step 2 (nothing did)
        assert driver.find_element(By.ID, "norms-unplotted").text == (
            "No finite L2 norm (a NaN or Inf in the state): model at step 3.")
        assert "model" in driver.find_element(By.ID, "norms").text
        driver.save_screenshot(str(tmp_path / "sick.png"))
        rows[0].find_element(By.CSS_SELECTOR, "a.diff").click()
        WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.ID, "diff") or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        bias = driver.find_element(By.CSS_SELECTOR, '#diff tr[data-path="model/1.bias"]').text
        assert "NaN/Inf appeared" in bias and "0 → 1" in bias
        assert bias.endswith("float32 (4,)")  # a 1-d shape as Python writes it (it was (4))
        assert "1 changed" in driver.find_element(By.ID, "diff-summary").text
        assert "loss" in driver.find_element(By.ID, "diff-metrics").text
        driver.save_screenshot(str(tmp_path / "diff.png"))
        driver.back()
        wait_ready(driver, "/p/dash/j/sick")
        driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step] a")[0].click()
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.ID, "tensors"))
        assert "model/1.bias: 1 NaN of 4 elements" in driver.find_element(By.ID, "reasons").text
        bias = driver.find_elements(By.CSS_SELECTOR, '#tensors tr[data-path="model/1.bias"] td')
        # min, max, mean, norm of a tensor holding a NaN (issue 30): never its finite part's
        assert [c.text for c in bias[4:9]] == ["NaN", "NaN", "NaN", "NaN", "1/0"]
        shapes = {r.get_attribute("data-path"): r.find_elements(By.TAG_NAME, "td")[2].text
                  for r in driver.find_elements(By.CSS_SELECTOR, "#tensors tr[data-path]")}
        assert shapes["model/1.bias"] == "(4,)" and shapes["model/0.weight"] == "(64, 32)"
    finally:
        driver.quit()
    assert (tmp_path / "diff.png").stat().st_size > 5000


def test_a_readers_verify_re_hashes_and_finds_corrupted_chunks(site: Site,
                                                               tmp_path: Path) -> None:
    """Issue 30: with a reader's key the button said "verified (every chunk present)" for a
    snapshot whose every chunk was corrupted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash/j/rot")
        assert driver.find_element(By.TAG_NAME, "h2").text == "dash/rot: 1 snapshot"  # not (s)
        row = driver.find_element(By.CSS_SELECTOR, "#timeline tr[data-step]")
        row.find_element(By.CSS_SELECTOR, "button[data-verify]").click()
        WebDriverWait(driver, 30).until(lambda d: "damaged" in row.text or "verified" in row.text)
        assert "damaged: chunks/" in row.text and "verified" not in row.text, row.text
    finally:
        driver.quit()


def test_a_refused_key_says_so_and_asks_for_another(site: Site,
                                                    tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    url, _, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        driver.get(f"{url}/#key=ciuic_000000000000_not-a-real-key-not-a-real")
        wait_ready(driver, "/")
        assert "refused" in driver.find_element(By.ID, "error").text
        assert driver.find_element(By.ID, "login").is_displayed()
    finally:
        driver.quit()


def test_a_link_with_the_key_opens_the_page_it_names(site: Site,
                                                    tmp_path: Path) -> None:
    """Issue 30: a link carrying the key (``#/p/P/j/J&key=...``) went to the projects' list;
    the key is taken, removed from the address bar, and the page the link names shown."""
    from selenium.webdriver.common.by import By

    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        driver.get(f"{url}/#/p/dash/j/adam&key={key}")
        wait_ready(driver, "/p/dash/j/adam")
        assert driver.execute_script("return location.hash") == "#/p/dash/j/adam"
        assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step]")) == 2
        assert driver.execute_script("return sessionStorage.getItem('ciuic-key')") == key
        driver.get(f"{url}/#key={key}&/p/dash")  # the key first; in the same tab
        wait_ready(driver, "/p/dash")
        assert driver.execute_script("return location.hash") == "#/p/dash"
        assert "adam" in driver.find_element(By.ID, "jobs").text
        assert key not in driver.current_url
    finally:
        driver.quit()


def test_the_optimizers_norm_leaves_its_step_counters_out(site: Site, tmp_path: Path) -> None:
    """Issue 30: the optimizer's norm on the plot was Adam's step counters' (30 x sqrt(2) at
    step 30), which dwarfed its moments."""
    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash/j/adam")
        titles = driver.execute_script(
            "return [...document.querySelectorAll('#norms circle title')]"
            ".map((t) => t.textContent)")
    finally:
        driver.quit()
    optimizer = [float(t.split("optimizer ")[1]) for t in titles if "optimizer" in t]
    assert len(optimizer) == 2 and all(0 < v < 5 for v in optimizer), titles


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A server holding job sup/default, killed once at step 6 under ``ciuic run`` (its runs
    column has notes); a reader key."""
    from tests.test_supervisor import supervise

    base = tmp_path_factory.mktemp("sup")
    store = base / "store"
    writer, reader = new_key(store, "sup", "writer"), new_key(store, "sup", "reader")
    with serve(store, base / "server.log") as url:
        run = supervise(base, "--steps", "10", "--every", "4", "--kill-at", "6:0",
                        "--endpoint", url, env={"CIUIC_API_KEY": writer})
        assert run.returncode == 0, run.stderr[-3000:]
        yield url, reader


def test_the_chain_shows_where_runs_stopped_and_why(stopped: tuple[str, str],
                                                    tmp_path: Path) -> None:
    """A job killed once under ``ciuic run`` against the server: the chain's runs column says
    where it stopped, why, and which restart resumed it."""
    from selenium.webdriver.common.by import By

    url, reader = stopped
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, reader, "/p/sup/j/default")
        notes = " ".join(c.text for c in driver.find_elements(By.CSS_SELECTOR, "td.notes"))
    finally:
        driver.quit()
    assert "stopped at step" in notes and "signal: SIGKILL (killed)" in notes, notes
    assert "(restart 1 by ciuic run)" in notes


def test_the_runs_column_fits_the_window_at_1000_1400_and_1920_pixels(
        stopped: tuple[str, str], tmp_path: Path) -> None:
    """Issue 42: at 1400 pixels the runs column (a kill's note, one line) ran 15 px past the
    window's right edge, and the page scrolled sideways; at 1000, 400 px."""
    url, reader = stopped
    driver = chrome(tmp_path / "profile")
    measured = {}
    try:
        open_page(driver, url, reader, "/p/sup/j/default")
        for width in (1400, 1000, 1920):
            driver.set_window_size(width, 900)
            measured[width] = driver.execute_script(
                "const notes = [...document.querySelectorAll('#timeline td.notes')];"
                "return {inner: window.innerWidth, page: document.documentElement.clientWidth,"
                " scroll: document.documentElement.scrollWidth,"
                " right: Math.max(...notes.map((c) => c.getBoundingClientRect().right)),"
                " table: document.getElementById('timeline').getBoundingClientRect().right,"
                " noted: notes.filter((c) => c.textContent.includes('stopped')).length}")
            driver.save_screenshot(str(tmp_path / f"chain-{width}.png"))
    finally:
        driver.quit()
    assert measured[1400]["inner"] == 1400, measured  # the window is what the test asked for
    for width, m in measured.items():
        assert m["noted"] == 1, (width, m)
        # the runs column and the table end inside the page; the page does not scroll sideways
        assert m["right"] <= m["page"] and m["table"] <= m["page"], (width, m)
        assert m["scroll"] <= m["page"], (width, m)


def test_a_project_the_key_does_not_open_replaces_the_page_with_the_error(
        site: Site, tmp_path: Path) -> None:
    """Issue 42: with a key of project dash, ``#/p/other/j/x`` showed the right error over the
    previous job's plots and table, and on a fresh load stayed at "Loading..." for ever."""
    from selenium.webdriver.common.by import By

    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash/j/train")
        assert driver.find_elements(By.ID, "chart") and driver.find_elements(By.ID, "timeline")
        driver.get(f"{url}/#/p/other/j/x")
        wait_ready(driver, "/p/other/j/x")
        assert driver.find_element(By.ID, "error").text == (
            "this key belongs to project 'dash', not 'other'")
        for gone in ("chart", "norms", "timeline"):
            assert not driver.find_elements(By.ID, gone), gone
        own = driver.find_element(By.ID, "own-project")
        assert "ciuic apikey create --project other --role reader" in own.text
        assert own.find_element(By.TAG_NAME, "a").get_attribute("href").endswith("#/p/dash")
        assert driver.find_element(By.ID, "crumbs").text == "projects / other / x"
    finally:
        driver.quit()
    fresh = chrome(tmp_path / "fresh")  # a new browser: the link is the first page it opens
    try:
        fresh.get(f"{url}/#/p/other/j/x&key={key}")
        wait_ready(fresh, "/p/other/j/x")
        assert "not 'other'" in fresh.find_element(By.ID, "error").text
        view = fresh.find_element(By.ID, "view").text
        assert "Loading" not in view and "This key opens project dash" in view, view
        assert "reader of dash" in fresh.find_element(By.ID, "who").text
        # "enter a key of other": the key is dropped and the sign-in form shown
        fresh.find_element(By.ID, "other-key").click()
        assert fresh.find_element(By.ID, "login").is_displayed()
        assert fresh.execute_script("return sessionStorage.getItem('ciuic-key')") is None
    finally:
        fresh.quit()


def test_a_job_that_does_not_exist_says_so_and_names_those_that_do(site: Site,
                                                                   tmp_path: Path) -> None:
    """Issue 42: ``#/p/dash/j/nope`` showed an empty job ("0 snapshots") with advice to record
    the loss; a job whose snapshots were all pruned says so; a project with no job says how
    one appears."""
    from selenium.webdriver.common.by import By

    url, key, others = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash/j/train")
        driver.get(f"{url}/#/p/dash/j/nope")
        wait_ready(driver, "/p/dash/j/nope")
        assert driver.find_element(By.ID, "error").text == "No such job: dash/nope."
        known = driver.find_element(By.ID, "known-jobs")
        assert known.text == "The jobs of dash: adam, gone, rot, sick, train."
        assert [a.get_attribute("href").split("#")[1] for a in known.find_elements(
            By.TAG_NAME, "a")][-1] == "/p/dash/j/train"
        view = driver.find_element(By.ID, "view").text
        assert "No loss recorded" not in view and "snapshots" not in view, view
        assert not driver.find_elements(By.ID, "timeline")
        # a job that exists, its one snapshot pruned: no plots, no advice, what happened
        driver.get(f"{url}/#/p/dash/j/gone")
        wait_ready(driver, "/p/dash/j/gone")
        assert driver.find_element(By.ID, "error").text == ""
        assert driver.find_element(By.ID, "no-snapshots").text.startswith(
            "Every snapshot of this job was pruned (1 snapshot)")
        assert not driver.find_elements(By.ID, "chart-none")
    finally:
        driver.quit()
    void = chrome(tmp_path / "void")
    try:
        open_page(void, url, others["void"], "/p/void")
        empty = void.find_element(By.ID, "no-jobs").text
        assert f'SnapshotManager("void", job="train", api_key=..., endpoint="{url}")' in empty
        void.get(f"{url}/#/p/void/j/train")
        wait_ready(void, "/p/void/j/train")
        assert void.find_element(By.ID, "error").text == "No such job: void/train."
        assert void.find_element(By.ID, "known-jobs").text == "void has no jobs yet."
    finally:
        void.quit()


def test_a_job_with_one_snapshot_labels_its_one_step_once(site: Site, tmp_path: Path) -> None:
    """A one-snapshot job's plots said "step 1" at both ends of the axis and its one value at
    both ends of the other: one label each now."""
    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash/j/rot")
        labels = driver.execute_script(
            "return [...document.querySelectorAll('#norms text')].map((t) => t.textContent)")
    finally:
        driver.quit()
    assert [t for t in labels if t.startswith("step")] == ["step 1"], labels
    assert len([t for t in labels if t[:1].isdigit()]) == 1, labels


def test_an_answer_for_a_page_already_left_is_dropped(site: Site, tmp_path: Path) -> None:
    """A slow job's chain arriving after the user went on to another page replaced that page
    (and said it was ready under the other page's address). The browser holds the chain's
    answers (from the real server) until the second page shows, then lets them through. While
    a page loads, the one shown is marked busy (dimmed): nothing said a click was under way."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key, _ = site
    driver = chrome(tmp_path / "profile")
    try:
        open_page(driver, url, key, "/p/dash")
        driver.execute_script(
            "window.held = []; const real = window.fetch;"
            "window.fetch = (u, o) => u.includes('/jobs/train/') ? new Promise("
            "  (done) => window.held.push(() => done(real(u, o)))) : real(u, o);"
            "location.hash = '/p/dash/j/train';")
        WebDriverWait(driver, 30).until(lambda d: d.execute_script("return window.held.length")
                                        == 2)
        assert driver.find_element(By.ID, "view").get_attribute("aria-busy") == "true"
        assert driver.find_element(By.ID, "jobs").is_displayed()  # the last page, dimmed
        driver.execute_script("location.hash = '/p/dash/j/sick'")
        wait_ready(driver, "/p/dash/j/sick")
        assert driver.find_element(By.ID, "view").get_attribute("aria-busy") is None
        driver.execute_script("window.held.forEach((go) => go())")
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(
            "return document.body.dataset.dropped || document.body.dataset.ready") != (
            "/p/dash/j/sick"))
        assert driver.execute_script("return document.body.dataset.ready") == "/p/dash/j/sick"
        assert driver.find_element(By.TAG_NAME, "h2").text == "dash/sick: 3 snapshots"
        # a snapshot's page, whose tensors come after the user went back to the jobs: dropped
        # too (the page caught the late answer and showed itself)
        driver.execute_script(
            "window.held = []; const real = window.fetch;"
            "window.fetch = (u, o) => u.includes('/tensors') ? new Promise("
            "  (done) => window.held.push(() => done(real(u, o)))) : real(u, o);")
        driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step] a")[0].click()
        WebDriverWait(driver, 30).until(lambda d: d.execute_script("return window.held.length")
                                        == 1)
        driver.execute_script("location.hash = '/p/dash'")
        wait_ready(driver, "/p/dash")
        driver.execute_script("window.held.forEach((go) => go())")
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(
            "return document.body.dataset.dropped") == "2" or d.find_element(
            By.TAG_NAME, "h2").text != "Jobs of dash")
        assert driver.find_element(By.TAG_NAME, "h2").text == "Jobs of dash"
    finally:
        driver.quit()


def test_a_server_stopped_under_the_page_is_named_and_its_old_page_cleared(
        tmp_path: Path) -> None:
    """The server stopped while the chain shows: a verify said "Failed to fetch", and a
    snapshot's link kept the chain under that line; both say the server did not answer now,
    and the page opened shows nothing stale."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    store = tmp_path / "store"
    writer, reader = new_key(store, "p", "writer"), new_key(store, "p", "reader")
    driver = chrome(tmp_path / "profile")
    try:
        with serve(store, tmp_path / "server.log") as url:
            with SnapshotManager("p", job="j", api_key=writer, endpoint=url,
                                 handle_signals=False) as m:
                m.save(1, {"w": torch.ones(8)}, loss=0.5)
                m.save(2, {"w": torch.ones(8) * 2}, loss=0.25)
            open_page(driver, url, reader, "/p/p/j/j")
        rows = driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step]")
        rows[0].find_element(By.CSS_SELECTOR, "button[data-verify]").click()
        state = rows[0].find_element(By.CSS_SELECTOR, "td[id^='state-']")
        WebDriverWait(driver, 30).until(lambda d: "..." not in state.text)
        assert state.text.startswith("The server did not answer"), state.text
        link = rows[1].find_element(By.CSS_SELECTOR, "a[href*='/s/']")
        target = link.get_attribute("href").split("#")[1]
        link.click()
        wait_ready(driver, target)
        error = driver.find_element(By.ID, "error").text
        assert error.startswith("The server did not answer") and "Reload" in error, error
        assert not driver.find_elements(By.ID, "timeline") and not driver.find_elements(
            By.ID, "chart")
        assert driver.find_element(By.ID, "crumbs").text == "projects / p"
    finally:
        driver.quit()
