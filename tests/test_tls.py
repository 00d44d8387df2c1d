"""HTTPS end to end: `ciuic serve --certfile --keyfile` with a self-signed certificate the test
makes; a client that trusts it (``CIUIC_CA``) saves, restores and lists through it; one that
does not is refused at once with a message that says what to set; plain HTTP on a public address
is refused unless asked for."""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager
from ciuic.errors import ConfigurationError, StoreAccessError
from ciuic.store.http import HttpStore
from tests.serverutil import cli, new_key, serve


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (cert, key) files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ciuic test server")])
    now = dt.datetime.now(dt.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "server.pem", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def ls(url: str, key: str, ca: Path | None) -> subprocess.CompletedProcess[str]:
    """`ciuic ls` of a project on the server, with CIUIC_CA set to ``ca`` or unset."""
    env = {k: v for k, v in os.environ.items() if k != "CIUIC_CA"}
    env.update({"CIUIC_API_KEY": key, "COLUMNS": "200", **({"CIUIC_CA": str(ca)} if ca else {})})
    return subprocess.run([sys.executable, "-m", "ciuic", "--store", f"{url}/v1/projects/p",
                           "ls"], capture_output=True, text=True, timeout=120, env=env)


def test_https_with_the_servers_certificate_trusted_through_ciuic_ca(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, private = self_signed(tmp_path)
    store = tmp_path / "store"
    key = new_key(store, "p", "writer")
    monkeypatch.delenv("CIUIC_CA", raising=False)
    with serve(store, tmp_path / "server.log", tls=(cert, private)) as url:
        assert url.startswith("https://")
        # not trusted: refused at once, saying what to set, without a traceback
        with pytest.raises(StoreAccessError, match=r"does not trust.*set CIUIC_CA"):
            HttpStore(url, "p", key).whoami()
        refused = ls(url, key, None)
        assert refused.returncode != 0
        assert "does not trust" in refused.stderr and "CIUIC_CA" in refused.stderr
        assert "Traceback" not in refused.stderr

        monkeypatch.setenv("CIUIC_CA", str(cert))
        model, back = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        with SnapshotManager("p", job="j", api_key=key, endpoint=url,
                             handle_signals=False) as m:
            for step in (1, 2):
                m.save(step, model, lr=0.5 * step)
        with SnapshotManager("p", job="j", api_key=key, endpoint=url,
                             handle_signals=False) as m:
            assert m.restore(back) == 2
        assert torch.equal(back.weight, model.weight) and torch.equal(back.bias, model.bias)
        listed = ls(url, key, cert)
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if "p/j" in line)
        assert row.split()[1:3] == ["2", "2"]  # snapshots, last step

    monkeypatch.setenv("CIUIC_CA", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigurationError, match=r"CIUIC_CA .* does not exist"):
        HttpStore("https://127.0.0.1:1", "p", key)


def test_serve_refuses_plain_http_on_a_public_address(tmp_path: Path) -> None:
    store = tmp_path / "store"
    public = cli(store, "serve", "--host", "0.0.0.0", "--port", "1")
    assert public.returncode == 2
    assert "cleartext" in public.stderr and "--certfile" in public.stderr
    cert, _ = self_signed(tmp_path)
    half = cli(store, "serve", "--certfile", str(cert))
    assert half.returncode == 2 and "both --certfile and --keyfile" in half.stderr


def test_a_client_warns_when_its_key_would_cross_the_network_in_cleartext(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ciuic"):
        HttpStore("http://127.0.0.1:1", "p", "k").close()
        assert "cleartext" not in caplog.text
        HttpStore("http://192.0.2.7:8470", "p", "k").close()
    assert "http://192.0.2.7:8470 is reached over plain HTTP" in caplog.text
    assert "cleartext" in caplog.text
