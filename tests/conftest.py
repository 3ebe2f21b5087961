"""Test-wide settings: keep IPython/Jupyter state out of the user's home."""

import os
import tempfile

_home = tempfile.mkdtemp(prefix="dpnb-test-home-")
for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                 ("JUPYTER_DATA_DIR", "jupyter-data"), ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
                 ("MPLCONFIGDIR", "mpl")):
    os.environ[var] = os.path.join(_home, sub)
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")
