from __future__ import annotations

import ciuic
import ciuic.errors


def test_public_api_is_guarded() -> None:
    assert sorted(ciuic.__all__) == sorted([
        "AmbiguousReference", "AutoInterval", "CaptureError", "CiuicError", "ConfigurationError",
        "CorruptObject", "HealthPolicy", "IntegrityError", "InvalidKey", "ObjectNotFound",
        "Repository",
        "RestoreError", "ResumableSampler", "SnapshotInfo", "SnapshotManager",
        "SnapshotNotFound", "StateHolder", "StateMismatch", "StoreError", "__version__",
        "recoverable", "register_adapter",
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


def test_the_import_paths_users_know_keep_working() -> None:
    from ciuic.data import ResumableSampler
    from ciuic.holder import StateHolder
    from ciuic.snapshot import ManagerStats, SnapshotManager
    from ciuic_client import CiuicClient

    assert SnapshotManager is ciuic.SnapshotManager
    assert ResumableSampler is ciuic.ResumableSampler
    assert StateHolder is ciuic.StateHolder
    assert ManagerStats().snapshots == 0
    assert callable(CiuicClient)


def test_every_exception_class_lives_in_errors_and_is_re_exported_where_it_was() -> None:
    """errors.py is the one place (its docstring draws the hierarchy); the modules that used to
    define an error still export the same class."""
    import ast
    from pathlib import Path

    import ciuic.chain.lease
    import ciuic.engine
    import ciuic.engine.staging
    import ciuic.format.crypto
    import ciuic.store.retry

    src = Path(ciuic.__file__).parent
    outside = []
    for path in src.rglob("*.py"):
        if path.name == "errors.py" and path.parent == src:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
                    for b in node.bases):
                outside.append(f"{path.relative_to(src)}: {node.name}")
    assert outside == []
    assert ciuic.chain.lease.FencedOut is ciuic.errors.FencedOut
    assert ciuic.format.crypto.MissingKey is ciuic.errors.MissingKey
    assert ciuic.store.retry.StoreTimeout is ciuic.errors.StoreTimeout
    assert ciuic.store.retry.DiskFull is ciuic.errors.DiskFull
    assert ciuic.engine.StagingBudgetExceeded is ciuic.errors.StagingBudgetExceeded
    assert ciuic.engine.staging.StagingBudgetExceeded is ciuic.errors.StagingBudgetExceeded
    doc = ciuic.errors.__doc__ or ""
    for name in ciuic.errors.__all__:
        assert name in doc, f"{name} is missing from the hierarchy in errors.py's docstring"


def test_damage_newer_formats_and_missing_keys_are_told_apart_by_type() -> None:
    e = ciuic.errors
    for cls in (e.CorruptObject, e.UnsupportedFormat):
        err = cls("chunks/ab/x", "why")
        assert isinstance(err, e.UnreadableObject) and err.key == "chunks/ab/x"
    missing = e.MissingKey("chunks/ab/x", "0123456789abcdef", "none")
    assert missing.key_id == "0123456789abcdef"
    assert not isinstance(missing, e.CorruptObject)
    assert not isinstance(e.UnsupportedFormat("k", "r"), e.CorruptObject)
