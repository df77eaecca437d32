"""Shared fixtures: the generated models in models/ and the real ones fetched by scripts/fetch_models.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "models"
REAL = Path(os.environ.get("OPSCOPE_MODELS", ROOT / "models" / "real"))
REAL_NAMES = ["ppocrv4_rec", "ppocrv4_det", "silero_vad_v6", "captcha_crnn", "magika_standard_v3_3"]


@pytest.fixture(autouse=True, scope="session")
def _weight_cache_of_this_run(tmp_path_factory) -> None:
    """Recordings cache weight sketches in the user's cache folder: tests use a fresh one of their own
    (subprocesses inherit it), so they neither read a stale entry nor leave files behind."""
    os.environ["OPSCOPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("weight-cache"))


def real_model_path(name: str) -> Path:
    """Path of a fetched real model; fails (never skips) when it has not been fetched."""
    path = REAL / f"{name}.onnx"
    if not path.is_file():
        pytest.fail(f"{path} missing: run `python scripts/fetch_models.py` first")
    return path


def generated_model_path(name: str) -> Path:
    path = GENERATED / f"{name}.onnx"
    if not path.is_file():
        pytest.fail(f"{path} missing: run `python scripts/make_models.py` first")
    return path


@pytest.fixture(params=REAL_NAMES)
def real_model(request) -> Path:
    return real_model_path(request.param)
