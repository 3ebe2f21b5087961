"""dpnb.core stays pure: no torch / numpy / IPython, typed and documented API."""

import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys

import dpnb.core as core

REPO = pathlib.Path(__file__).resolve().parents[2]
CORE_DIR = REPO / "dpnb" / "core"


def test_import_does_not_pull_heavy_modules() -> None:
    code = (
        "import dpnb.core, sys; "
        "bad = [m for m in ('torch', 'IPython', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (
        "importing dpnb.core pulled in a heavy module; if the traceback goes through "
        f"dpnb/__init__.py, that file must stay light.\n{proc.stderr}"
    )


def test_no_heavy_import_statements_in_core_sources() -> None:
    pattern = re.compile(r"^\s*(import|from)\s+(torch|numpy|IPython)\b", re.MULTILINE)
    offenders = [p.name for p in CORE_DIR.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def _public_callables() -> list[tuple[str, object]]:
    return [(n, getattr(core, n)) for n in core.__all__ if callable(getattr(core, n))]


def test_public_api_is_documented_and_typed() -> None:
    for name, obj in _public_callables():
        assert inspect.getdoc(obj), f"{name} has no docstring"
        if inspect.isclass(obj):
            if issubclass(obj, Exception):
                continue
            assert dataclasses.is_dataclass(obj), f"{name} should be a dataclass"
            assert obj.__dataclass_params__.frozen, f"{name} should be frozen"  # type: ignore[attr-defined]
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    assert member.__doc__, f"{name}.{attr} has no docstring"
                    assert "return" in member.fget.__annotations__, f"{name}.{attr} lacks a return type"
                elif inspect.isfunction(member):
                    assert member.__doc__, f"{name}.{attr} has no docstring"
                    sig = inspect.signature(member)
                    assert sig.return_annotation is not inspect.Signature.empty, f"{name}.{attr}"
            continue
        sig = inspect.signature(obj)  # type: ignore[arg-type]
        for pname, param in sig.parameters.items():
            assert param.annotation is not inspect.Parameter.empty, f"{name}({pname}) is not annotated"
        assert sig.return_annotation is not inspect.Signature.empty, f"{name} has no return annotation"


def test_config_error_is_value_error() -> None:
    assert issubclass(core.ConfigError, ValueError)
