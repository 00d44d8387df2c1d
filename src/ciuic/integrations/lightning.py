"""PyTorch Lightning, as the ``lightning.pytorch`` package: ``CiuicCallback`` snapshots a ``fit``
into ciuic and resumes it bit-exactly. ::

    from ciuic.integrations.lightning import CiuicCallback

    trainer = Trainer(max_epochs=3, callbacks=[CiuicCallback("proj", job="run-1",
                                                             every_n_train_steps=50)])
    trainer.fit(model, datamodule=dm)   # resumes from the job's latest snapshot by itself

How it hooks in: :mod:`ciuic.integrations._lightning`.
"""

from __future__ import annotations

import lightning.pytorch as pl

from ciuic.integrations._lightning import build

__all__ = ["CiuicCallback"]

CiuicCallback = build(pl)
CiuicCallback.__module__ = __name__
