"""Client-side encryption: AES-256-GCM for every object, keyed names for chunks.

A key is 32 random bytes, written as ``ciuic-key-v1:<base64url>`` (``ciuic keygen`` prints one).
From it three independent subkeys are derived with BLAKE3's key-derivation mode: the AES-256-GCM
key, the *name key* (chunk, body and snapshot names are BLAKE3 keyed hashes of the plaintext, so
identical data still deduplicates but the store cannot test a guess of the plaintext), and the
*key ID* (16 hex characters, recorded in every sealed object so that a reader can say which key
it needs, and several keys can be configured for reading: rotation).

A sealed object uses the chunk frame (``chunks.py``) with cipher 1::

    header (16 bytes, cipher = 1, plaintext length) | key ID (8 bytes) | nonce (12) | ciphertext+tag

The header and the object's store key are the associated data: a sealed object moved to another
name, or with an edited header, fails authentication.

Keys come from ``CIUIC_ENCRYPTION_KEY`` (the key text), ``CIUIC_ENCRYPTION_KEY_FILE`` (a file
holding it), or ``CIUIC_ENCRYPTION_PASSPHRASE`` (scrypt, memory-hard, with a random salt kept in
the store); that key seals. ``CIUIC_DECRYPTION_KEYS`` (comma-separated key texts) adds keys
that only open, for data sealed before a rotation.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ciuic.errors import ConfigurationError, CorruptObject, MissingKey
from ciuic.format import chunks as ck
from ciuic.format.digest import Buffer

KEY_PREFIX = "ciuic-key-v1:"
_ID_BYTES = 8
_NONCE_BYTES = 12
_TAG_BYTES = 16
#: what a sealed object takes beyond its payload: header, key ID, nonce, tag
SEALED_OVERHEAD = ck.HEADER_BYTES + _ID_BYTES + _NONCE_BYTES + _TAG_BYTES
_TAMPERED = ("authentication failed: the sealed object was tampered with, damaged, or moved "
             "from another name")
CIPHER_AES_GCM = 1


def _derive(context: str, secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=f"ciuic 2026-11 {context}").digest()


@dataclass(frozen=True)
class Key:
    secret: bytes = field(repr=False)

    @property
    def id(self) -> str:
        return _derive("key id", self.secret)[:_ID_BYTES].hex()

    @property
    def name_key(self) -> bytes:
        return _derive("object names", self.secret)

    @property
    def aead(self) -> AESGCM:
        return AESGCM(_derive("aes-256-gcm", self.secret))


def generate_key_text() -> str:
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii")


def parse_key_text(text: str, source: str = "key") -> Key:
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        raise ConfigurationError(f"{source} is not a ciuic key (it should start with "
                                 f"{KEY_PREFIX!r}); make one with `ciuic keygen`")
    try:
        secret = base64.urlsafe_b64decode(text[len(KEY_PREFIX):].encode("ascii"))
    except (ValueError, UnicodeEncodeError) as e:
        raise ConfigurationError(f"{source} is not valid base64: {e}") from e
    if len(secret) != 32:
        raise ConfigurationError(f"{source} holds {len(secret)} bytes, not 32; make a key with "
                                 "`ciuic keygen`")
    return Key(secret)


#: scrypt parameters: 2**15 x 8 x 128 bytes = 32 MiB of memory per derivation (memory-hard).
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1


def key_from_passphrase(passphrase: str, salt: bytes) -> Key:
    """Derive a key from a passphrase with scrypt and the store's random salt (kept in the store
    at :data:`ciuic.format.layout.PASSPHRASE_SALT`, so every writer derives the same key)."""
    if len(passphrase) < 12:
        raise ConfigurationError("CIUIC_ENCRYPTION_PASSPHRASE is too short: use at least 12 "
                                 "characters, or a generated key (`ciuic keygen`)")
    secret = hashlib.scrypt(passphrase.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                            maxmem=64 * 1024 * 1024, dklen=32)
    return Key(secret)


class Keyring:
    """The configured keys: the first seals, all of them open."""

    def __init__(self, keys: list[Key]) -> None:
        self.keys = keys
        self._by_id = {k.id: k for k in keys}
        self._aead = {k.id: k.aead for k in keys}

    @classmethod
    def from_env(cls, salt: Callable[[], bytes] | None = None) -> Keyring:
        """The keys configured in the environment. A passphrase needs ``salt``, which returns
        the store's salt (creating it on first use)."""
        keys: list[Key] = []
        text = os.environ.get("CIUIC_ENCRYPTION_KEY")
        path = os.environ.get("CIUIC_ENCRYPTION_KEY_FILE")
        passphrase = os.environ.get("CIUIC_ENCRYPTION_PASSPHRASE")
        if passphrase and not (text or path):
            if salt is None:
                raise ConfigurationError("CIUIC_ENCRYPTION_PASSPHRASE needs a store (its salt)")
            keys.append(key_from_passphrase(passphrase, salt()))
        if text:
            keys.append(parse_key_text(text, "CIUIC_ENCRYPTION_KEY"))
        elif path:
            try:
                content = Path(path).expanduser().read_text()
            except OSError as e:
                raise ConfigurationError(f"cannot read CIUIC_ENCRYPTION_KEY_FILE {path}: {e}"
                                         ) from e
            keys.append(parse_key_text(content, f"the key file {path}"))
        for i, extra in enumerate(filter(None, os.environ.get("CIUIC_DECRYPTION_KEYS",
                                                              "").split(","))):
            keys.append(parse_key_text(extra, f"CIUIC_DECRYPTION_KEYS item {i + 1}"))
        return cls(keys)

    @property
    def sealing(self) -> Key | None:
        return self.keys[0] if self.keys else None

    def seal(self, name: str, plain: Buffer, encoded: bytes | None = None) -> list[Buffer]:
        """The sealed form of ``plain`` stored under ``name``, as buffers to write in order.
        With ``encoded`` (the float codec's payload for ``plain``) that payload is sealed."""
        key = self.sealing
        if key is None:
            raise ConfigurationError("no encryption key is configured: set CIUIC_ENCRYPTION_KEY "
                                     "(make one with `ciuic keygen`)")
        codec = ck.CODEC_RAW if encoded is None else ck.CODEC_FLOAT
        header = ck.header(len(plain), cipher=CIPHER_AES_GCM, codec=codec)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        body = bytes(plain) if encoded is None else encoded
        sealed = self._aead[key.id].encrypt(nonce, body, header + name.encode())
        return [header, bytes.fromhex(key.id), nonce, sealed]

    def open(self, name: str, blob: Buffer) -> tuple[bytes, Key]:
        """Authenticate and decrypt a sealed object; returns the plaintext and the key used."""
        header, length, key, nonce, body = self._parts(name, blob)
        plain = self._decrypt(name, key, nonce, body, header)
        codec = ck.codec_of(header)
        if codec != ck.CODEC_RAW:
            plain = bytes(ck.decode_payload(name, codec, plain, length))
        if len(plain) != length:
            raise CorruptObject(name, "sealed length does not match the header")
        return plain, key

    def open_into(self, name: str, blob: Buffer, dest: memoryview) -> Key:
        """:meth:`open`, the plaintext written into ``dest`` (of the header's length): a raw
        payload is decrypted straight into it, with no copy in between."""
        header, length, key, nonce, body = self._parts(name, blob)
        aead = self._aead[key.id]
        if (length != len(dest) or ck.codec_of(header) != ck.CODEC_RAW
                or not hasattr(aead, "decrypt_into")):
            # another length (authenticated first: a moved object says so), a compressed
            # payload, or cryptography < 44
            plain = self.open(name, blob)[0]
            if len(plain) != len(dest):
                raise CorruptObject(name, f"length {len(plain)} differs from the expected "
                                    f"{len(dest)}")
            dest[:] = plain
            return key
        if len(body) != length + _TAG_BYTES:
            raise CorruptObject(name, "sealed length does not match the header")
        try:
            aead.decrypt_into(nonce, body, header + name.encode(), dest)
        except InvalidTag:
            raise CorruptObject(name, _TAMPERED) from None
        return key

    def _parts(self, name: str, blob: Buffer) -> tuple[bytes, int, Key, bytes, memoryview]:
        """A sealed object's header, plaintext length, key, nonce and ciphertext (checked)."""
        view = memoryview(blob).cast("B")
        header = bytes(view[:ck.HEADER_BYTES])
        length = ck.check_header(name, header, len(view), sealed=True)
        start = ck.HEADER_BYTES + _ID_BYTES + _NONCE_BYTES
        if len(view) < start + _TAG_BYTES:
            raise CorruptObject(name, "truncated sealed object")
        key_id = bytes(view[ck.HEADER_BYTES:ck.HEADER_BYTES + _ID_BYTES]).hex()
        key = self._by_id.get(key_id)
        if key is None:
            raise MissingKey(name, key_id, ", ".join(self._by_id) or "none")
        return header, length, key, bytes(view[ck.HEADER_BYTES + _ID_BYTES:start]), view[start:]

    def _decrypt(self, name: str, key: Key, nonce: bytes, body: memoryview, header: bytes
                 ) -> bytes:
        try:
            return self._aead[key.id].decrypt(nonce, body, header + name.encode())
        except InvalidTag:
            raise CorruptObject(name, _TAMPERED) from None

    def name_key(self, key_id: str) -> bytes:
        return self._by_id[key_id].name_key


class ObjectCodec:
    """How a writer names and frames objects: plain, or sealed with the keyring's first key."""

    def __init__(self, keyring: Keyring | None = None) -> None:
        if keyring is not None and keyring.sealing is None:
            raise ConfigurationError(
                "encryption=True needs a key, and none is configured. Create one with "
                "`ciuic keygen > ~/.ciuic-key && chmod 600 ~/.ciuic-key`, then set "
                "CIUIC_ENCRYPTION_KEY_FILE=~/.ciuic-key (or CIUIC_ENCRYPTION_KEY to the key "
                "itself). Keep the key safe: without it the snapshots cannot be read."
            )
        self.keyring = keyring
        self.name_key = keyring.sealing.name_key if keyring and keyring.sealing else None

    @property
    def sealed(self) -> bool:
        return self.keyring is not None

    def name(self, data: Buffer) -> str:
        from ciuic.format.digest import digest

        return digest(data, key=self.name_key)

    def chunk(self, key: str, piece: Buffer, encoded: bytes | None = None) -> list[Buffer]:
        """The stored form of a chunk; ``encoded``: its float-codec payload, if compressed."""
        if self.keyring:
            return self.keyring.seal(key, piece, encoded)
        return ck.frame(piece, encoded)

    def meta(self, key: str, data: bytes) -> bytes | list[Buffer]:
        return self.keyring.seal(key, data) if self.keyring else data
