"""The one-line training conveniences of :class:`dpnb.Cluster` (``c.wrap``, ``c.train``, ...).

The training layer (:mod:`dpnb.train`, :mod:`dpnb.resize`, :mod:`dpnb.export`)
takes a cluster as its argument and sits above this package; these methods
import it only when called, so the cluster package never depends on it at
import time.
"""

from __future__ import annotations


class TrainingMethods:
    """Mixed into :class:`dpnb.Cluster`."""

    # One-line conveniences; the training layer takes the cluster as its
    # argument and is imported only when one of these is called.
    def wrap(self, model: str = "model", strategy: str = "ddp", **opts) -> dict:
        """Wrap a model that exists on every rank; see :func:`dpnb.train.wrap`."""
        from .. import train

        return train.wrap(self, model, strategy, **opts)

    def set_data(self, dataset: str, **opts) -> dict:
        from .. import train

        return train.set_data(self, dataset, **opts)

    def train(self, **opts) -> dict:
        """Run training steps with live progress; see :func:`dpnb.train.train`."""
        from .. import train

        return train.train(self, **opts)

    def resize(self, n: int, **opts) -> dict:
        """Go on training on ``n`` ranks; see :func:`dpnb.resize.resize`."""
        from .. import resize

        return resize.resize(self, n, **opts)

    def check(self, model: str | None = None) -> dict:
        from .. import train

        return train.check(self, model)

    def save(self, path: str) -> dict:
        from .. import train

        return train.save(self, path)

    def load(self, path: str) -> dict:
        from .. import train

        return train.load(self, path)

    def pull_model(self) -> dict:
        from .. import train

        return train.pull_model(self)

    def export(self, out_dir: str, **opts) -> dict:
        """Write this session as a batch job; see :func:`dpnb.export.export`."""
        from .. import export

        return export.export(self, out_dir, **opts)
