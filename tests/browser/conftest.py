"""The browser tier's fixtures: ``lab`` (a JupyterLab server) and ``browser`` (Chromium)."""

from helpers.labpage import browser, lab  # noqa: F401  (fixtures, defined once)
