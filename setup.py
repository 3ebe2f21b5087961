"""Only a fix for editable installs; everything else is in pyproject.toml.

setuptools' editable wheel installs the data files (JupyterLab's prebuilt
``share/jupyter/labextensions/dpnb`` and the server extension's switch in
``etc/jupyter``) only if the distribution answers ``has_data()`` -- a name
distutils never defined (it has ``has_data_files()``), so ``pip install -e .``
silently left them out and JupyterLab never saw dpnb's sidebar.
"""

from setuptools import setup
from setuptools.dist import Distribution


class _Distribution(Distribution):
    def has_data(self) -> bool:
        return self.has_data_files()


setup(distclass=_Distribution)
