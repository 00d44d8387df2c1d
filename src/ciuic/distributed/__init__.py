"""Multi-rank snapshots: ciuic's own collective (gloo groups), the capture and the plan (who
writes which piece), the two-phase commit, and the resharded restore.

May import: ``chain``, ``restore``, ``state``, ``engine``, ``format``, ``store`` and the
foundation modules.
"""
