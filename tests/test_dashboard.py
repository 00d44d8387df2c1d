"""The dashboard in a real headless Chromium (Debian's chromium + chromedriver, through
Selenium) against a real `ciuic serve` process: load, navigate projects -> jobs -> the chain ->
a snapshot, verify a snapshot, screenshot every page."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager
from tests.test_health import train_with_adam
from tests.test_server import new_key, serve


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
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A server holding job dash/train with four snapshots (loss recorded); a reader key."""
    base = tmp_path_factory.mktemp("dash")
    store = base / "store"
    writer = new_key(store, "dash", "writer")
    reader = new_key(store, "dash", "reader")
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
        with SnapshotManager("dash", job="rot", api_key=writer, endpoint=url,
                             handle_signals=False) as m:
            m.save(1, {"w": torch.randn(3000), "b": torch.randn(70)})
        for path in set(chunks.rglob("*")) - before:
            if path.is_file():
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        yield url, reader, base


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


def test_load_navigate_verify_and_screenshot(site: tuple[str, str, Path],
                                             tmp_path: Path) -> None:
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


def test_health_plots_and_the_diff_of_two_snapshots(site: tuple[str, str, Path],
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


def test_a_readers_verify_re_hashes_and_finds_corrupted_chunks(site: tuple[str, str, Path],
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


def test_a_refused_key_says_so_and_asks_for_another(site: tuple[str, str, Path],
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


def test_a_link_with_the_key_opens_the_page_it_names(site: tuple[str, str, Path],
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


def test_the_optimizers_norm_leaves_its_step_counters_out(site: tuple[str, str, Path],
                                                          tmp_path: Path) -> None:
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


def test_the_chain_shows_where_runs_stopped_and_why(tmp_path: Path) -> None:
    """A job killed once under ``ciuic run`` against the server: the chain's runs column says
    where it stopped, why, and which restart resumed it."""
    from selenium.webdriver.common.by import By

    from tests.test_supervisor import supervise

    store = tmp_path / "store"
    writer, reader = new_key(store, "sup", "writer"), new_key(store, "sup", "reader")
    with serve(store, tmp_path / "server.log") as url:
        run = supervise(tmp_path, "--steps", "10", "--every", "4", "--kill-at", "6:0",
                        "--endpoint", url, env={"CIUIC_API_KEY": writer})
        assert run.returncode == 0, run.stderr[-3000:]
        driver = chrome(tmp_path / "profile")
        try:
            open_page(driver, url, reader, "/p/sup/j/default")
            notes = " ".join(c.text for c in driver.find_elements(By.CSS_SELECTOR, "td.notes"))
        finally:
            driver.quit()
    assert "stopped at step" in notes and "signal: SIGKILL (killed)" in notes, notes
    assert "(restart 1 by ciuic run)" in notes
