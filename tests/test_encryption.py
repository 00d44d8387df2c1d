"""Client-side encryption: sealed objects, keyed names, wrong keys, rotation, tampering."""

from __future__ import annotations

import shutil
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import ConfigurationError, RestoreError, SnapshotManager, cli, knobs
from ciuic.chain.read import chunk_refs, read_body
from ciuic.chain.repo import Repository
from ciuic.chain.verify import verify_job
from ciuic.format.crypto import generate_key_text, parse_key_text
from tests import models
from tests.helpers.stored import flip, stored_at


@pytest.fixture
def key(monkeypatch: pytest.MonkeyPatch) -> str:
    text = generate_key_text()
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", text)
    monkeypatch.delenv("CIUIC_ENCRYPTION_KEY_FILE", raising=False)
    monkeypatch.delenv("CIUIC_DECRYPTION_KEYS", raising=False)
    return text


model_opt = partial(models.model_opt, 256, 256, optimizer=torch.optim.Adam)


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 256)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_seed_code_with_encryption_runs_and_restores(store_dir: Path, key: str) -> None:
    model, optimizer = model_opt()
    snapshot_manager = SnapshotManager(project_id="deepseek_v2", api_key="your_api_key",
                                       save_interval=2, encryption=True, store=store_dir)
    for step in range(5):
        train(model, optimizer)
        snapshot_manager.step(step, model, optimizer)
    snapshot_manager.close()
    fresh, fresh_opt = model_opt(seed=1)
    with SnapshotManager("deepseek_v2", store=store_dir) as m:  # reading needs only the key
        assert m.restore(fresh, fresh_opt) == 4
    assert torch.equal(fresh.weight, model.weight)
    assert verify_job(Repository.open(store_dir), "deepseek_v2", "default", deep=True).ok


def test_no_key_says_how_to_make_one(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CIUIC_ENCRYPTION_KEY", "CIUIC_ENCRYPTION_KEY_FILE", "CIUIC_DECRYPTION_KEYS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigurationError, match="ciuic keygen"):
        SnapshotManager("p", encryption=True, store=store_dir)
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", "hunter2")
    with pytest.raises(ConfigurationError, match="not a ciuic key"):
        SnapshotManager("p", encryption=True, store=store_dir)


def test_no_plaintext_reaches_the_store(store_dir: Path, key: str) -> None:
    model, opt = model_opt()
    train(model, opt)
    with SnapshotManager("secretproject", job="j", encryption=True, store=store_dir) as m:
        m.save(7, model, opt, loss=0.123456)
    raw = model.weight.detach().numpy().tobytes()
    probes = [raw[i:i + 32] for i in range(0, len(raw) - 32, len(raw) // 16)]
    for path in (store_dir / "objects").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(p in data for p in probes), f"plaintext tensor bytes in {path}"
            assert b'"step"' not in data and b"0.123456" not in data, path


def test_dedup_still_works_with_encryption(store_dir: Path, key: str) -> None:
    model, opt = model_opt()
    with SnapshotManager("p", job="dd", encryption=True, store=store_dir) as m:
        first = m.save(0, model, opt)
        second = m.save(1, model, opt)
    assert first.new_bytes > 256 * 256 * 4
    assert second.new_bytes < 16 * 1024  # only the RNG state changed


def test_a_wrong_key_names_the_key_needed(store_dir: Path, key: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_opt()
    with SnapshotManager("p", job="wk", encryption=True, store=store_dir) as m:
        m.save(0, model, opt)
    needed = parse_key_text(key).id
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    with SnapshotManager("p", job="wk", store=store_dir) as m2, pytest.raises(
            RestoreError) as e:
        m2.restore(model, opt)
    assert needed in str(e.value) and "CIUIC_DECRYPTION_KEYS" in str(e.value)


def saved_then_rotated(store_dir: Path, key: str, job: str, model: nn.Module,
                       opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Save step 0 sealed with ``key``, then rotate: a new key seals, ``key`` still opens.
    Returns the new key."""
    with SnapshotManager("p", job=job, encryption=True, store=store_dir) as m:
        m.save(0, model, opt)
    new_key = generate_key_text()
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", new_key)
    monkeypatch.setenv("CIUIC_DECRYPTION_KEYS", key)
    return new_key


def test_a_missing_key_is_not_taken_for_damage(store_dir: Path, key: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The latest snapshot is sealed with a newer key the process lacks: a restore that fell
    back to an older snapshot (one it could open) would silently lose the newer steps."""
    model, opt = model_opt()
    newer = saved_then_rotated(store_dir, key, "mk", model, opt, monkeypatch)
    with SnapshotManager("p", job="mk", encryption=True, store=store_dir) as m:
        assert m.restore(model, opt) == 0
        m.save(1, model, opt)
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", key)  # the newer key is forgotten
    monkeypatch.delenv("CIUIC_DECRYPTION_KEYS")
    fresh, fresh_opt = model_opt(seed=2)
    with SnapshotManager("p", job="mk", store=store_dir) as m2, pytest.raises(
            RestoreError, match="nothing was restored") as e:
        m2.restore(fresh, fresh_opt)
    assert parse_key_text(newer).id in str(e.value)
    assert "CIUIC_ENCRYPTION_KEY_FILE" in str(e.value)
    assert m2.restored is None and not torch.equal(fresh.weight, model.weight)


def test_rotation_old_key_still_opens(store_dir: Path, key: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_opt()
    saved_then_rotated(store_dir, key, "rot", model, opt, monkeypatch)
    with SnapshotManager("p", job="rot", encryption=True, store=store_dir) as m2:
        assert m2.restore(model, opt) == 0
        train(model, opt)
        m2.save(1, model, opt)
    monkeypatch.delenv("CIUIC_DECRYPTION_KEYS")
    with SnapshotManager("p", job="rot", store=store_dir) as m3:
        assert m3.restore(model, opt) == 1  # sealed with the new key only


def test_tampering_is_detected(store_dir: Path, key: str) -> None:
    """Chunk objects moved to another name or flipped (pieces swapped inside a pack:
    tests/test_packs.py)."""
    model, opt = model_opt()
    with knobs.override(pack_bytes=0), SnapshotManager("p", job="tam", encryption=True,
                                                       store=store_dir) as m:
        m.save(0, model, opt)
        train(model, opt)
        m.save(1, model, opt)
    chunks = sorted(p for p in (store_dir / "objects" / "chunks").rglob("*") if p.is_file())
    a, b = chunks[0], chunks[1]
    swapped = a.read_bytes()
    shutil.copyfile(b, a)  # an object moved to another name
    flipped = bytearray(chunks[2].read_bytes())
    flipped[40] ^= 1
    chunks[2].write_bytes(bytes(flipped))
    report = verify_job(Repository.open(store_dir), "p", "tam", deep=True)
    reasons = {p.key: p.reason for p in report.problems or []}
    rel = str(a.relative_to(store_dir / "objects"))
    assert "authentication failed" in reasons[rel]
    assert "authentication failed" in reasons[str(chunks[2].relative_to(store_dir / "objects"))]
    assert swapped != a.read_bytes()


def test_keygen_prints_a_usable_key(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["ciuic", "keygen"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert not e.value.code
    out, err = capsys.readouterr()
    k = parse_key_text(out.strip())
    assert k.id in err and len(k.id) == 16


def test_a_passphrase_derives_the_same_key_for_every_writer(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CIUIC_ENCRYPTION_KEY", "CIUIC_ENCRYPTION_KEY_FILE", "CIUIC_DECRYPTION_KEYS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CIUIC_ENCRYPTION_PASSPHRASE", "correct horse battery staple")
    model, opt = model_opt()
    with SnapshotManager("p", job="pw", encryption=True, store=store_dir) as m:
        m.save(3, model, opt)
    fresh, fresh_opt = model_opt(seed=2)
    with SnapshotManager("p", job="pw", store=store_dir) as m2:
        assert m2.restore(fresh, fresh_opt) == 3
    assert torch.equal(fresh.weight, model.weight)
    monkeypatch.setenv("CIUIC_ENCRYPTION_PASSPHRASE", "incorrect horse battery staple")
    with SnapshotManager("p", job="pw", store=store_dir) as m3, pytest.raises(
            RestoreError, match="sealed with key"):
        m3.restore(fresh, fresh_opt)
    monkeypatch.setenv("CIUIC_ENCRYPTION_PASSPHRASE", "short")
    with pytest.raises(ConfigurationError, match="too short"):
        SnapshotManager("p", job="pw2", encryption=True, store=store_dir)


def test_verify_without_the_key_says_so_once_per_key(store_dir: Path, key: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    from tests.test_cli import ciuic

    model, opt = model_opt()
    with SnapshotManager("p", job="vk", encryption=True, store=store_dir) as m:
        for step in range(3):
            m.save(step, model, opt)
    monkeypatch.delenv("CIUIC_ENCRYPTION_KEY")
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(store_dir), "verify", "--deep")
    out = " ".join(out.split())
    assert code == 1
    assert out.count(f"sealed with key {parse_key_text(key).id}") == 1, out
    assert "could not be checked" in out and "CIUIC_ENCRYPTION_KEY_FILE" in out


@pytest.mark.parametrize("compression", ["off", "on"])
def test_sealed_chunks_restore_and_a_tampered_one_falls_back(
        store_dir: Path, key: str, compression: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A restore with a key decrypts each sealed chunk straight into the live tensor (a
    compressed one through its decoder); a tampered chunk fails authentication, and the restore
    falls back to the previous snapshot. A plain snapshot in the same store still restores."""
    model, opt = model_opt()
    monkeypatch.delenv("CIUIC_ENCRYPTION_KEY")
    with SnapshotManager("p", job="mix", store=store_dir, compression=compression) as m:
        m.save(0, model, opt)  # plain: written before encryption was turned on
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", key)
    train(model, opt)
    sealed = {k: v.clone() for k, v in model.state_dict().items()}
    with SnapshotManager("p", job="mix", encryption=True, store=store_dir,
                         compression=compression) as m:
        m.restore(nn.Linear(256, 256))  # the chain continues from step 0
        first = m.save(1, model, opt)
        train(model, opt)
        latest = m.save(2, model, opt)
    repo = Repository.open(store_dir)
    older = set(chunk_refs(read_body(repo, first)[1]))
    refs = chunk_refs(read_body(repo, latest)[1]["model"])
    victim = next(d for d in refs if d not in older)
    flip(store_dir, refs[victim], 60, 1)
    for snapshot, step, want in ((None, 1, sealed), ("mix@0", 0, plain)):
        fresh, fresh_opt = model_opt(seed=5)
        with SnapshotManager("p", job="mix", store=store_dir) as m:
            assert m.restore(fresh, fresh_opt, snapshot=snapshot) == step
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    assert "authentication failed" in caplog.text and "falling back" in caplog.text


def test_restore_without_the_key_names_the_key_and_talks_of_no_damage(
        store_dir: Path, key: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 30: a key that is not configured was followed by "No intact snapshot before it
    was found; ciuic verify --deep ... names every damaged object": nothing is damaged."""
    from tests.test_cli import ciuic

    model, opt = model_opt()
    with SnapshotManager("p", job="nokey", encryption=True, store=store_dir) as m:
        for step in range(3):
            m.save(step, model, opt)
    monkeypatch.delenv("CIUIC_ENCRYPTION_KEY")
    for command in (("restore", "nokey@2", "--to", str(tmp_path / "out.safetensors")),
                    ("show", "nokey@2"), ("inspect", "nokey@2"),
                    ("diff", "nokey@1", "nokey@2")):
        code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), *command)
        text = " ".join((out + err).split())
        assert code != 0, (command, text)
        assert f"sealed with key {parse_key_text(key).id}, which is not configured" in text
        assert "CIUIC_ENCRYPTION_KEY_FILE" in text, (command, text)
        assert "damage" not in text and "intact" not in text, (command, text)
    assert not (tmp_path / "out.safetensors").exists()


def test_restore_of_a_damaged_snapshot_says_which_earlier_ones_need_a_key(
        store_dir: Path, key: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The earlier snapshots are sealed with a key that is not configured: they may be intact,
    and the advice says which key would let them be checked, not that none is intact."""
    from tests.test_cli import ciuic

    model, opt = model_opt()
    saved_then_rotated(store_dir, key, "rot", model, opt, monkeypatch)
    train(model, opt)
    with SnapshotManager("p", job="rot", encryption=True, store=store_dir) as m:
        latest = m.save(1, model, opt)
    repo = Repository.open(store_dir)
    victim = next(iter(chunk_refs(read_body(repo, latest)[1]["model"]).values()))
    repo.close()
    flip(store_dir, victim, stored_at(store_dir, victim)[2] - 1, 1)
    monkeypatch.delenv("CIUIC_DECRYPTION_KEYS")  # step 0's key is forgotten
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store_dir), "restore", "rot@1",
                           "--to", str(tmp_path / "out.pt"))
    text = " ".join((out + err).split())
    assert code != 0
    assert "authentication failed" in text  # step 1 is damaged: that is said
    assert "No intact snapshot" not in text, text
    assert (f"1 earlier snapshot could not be checked: sealed with key "
            f"{parse_key_text(key).id}, which is not configured") in text, text
