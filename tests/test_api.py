from __future__ import annotations

import ciuic
import ciuic.errors


def test_public_api_is_guarded() -> None:
    assert sorted(ciuic.__all__) == sorted([
        "AmbiguousReference", "CaptureError", "CiuicError", "ConfigurationError",
        "CorruptObject", "IntegrityError", "InvalidKey", "ObjectNotFound", "Repository",
        "RestoreError", "ResumableSampler", "SnapshotInfo", "SnapshotManager",
        "SnapshotNotFound", "StateHolder", "StateMismatch", "StoreError", "__version__",
    ])
    for name in ciuic.__all__:
        assert hasattr(ciuic, name), name


def test_errors_derive_from_root_and_builtins() -> None:
    for name in ciuic.errors.__all__:
        cls = getattr(ciuic.errors, name)
        assert issubclass(cls, ciuic.errors.CiuicError)
    assert issubclass(ciuic.errors.ObjectNotFound, KeyError)
    assert issubclass(ciuic.errors.SnapshotNotFound, LookupError)
    assert issubclass(ciuic.errors.StateMismatch, ValueError)


def test_seed_import_path() -> None:
    from ciuic.snapshot import SnapshotManager

    assert SnapshotManager is ciuic.SnapshotManager
