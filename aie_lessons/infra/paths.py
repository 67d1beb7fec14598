"""Where the course keeps its files, so every tool and notebook agrees without configuration."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"
MODELS_DIR = DATA_DIR / "models"
CACHE_DIR = DATA_DIR / "cache"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# `aie fetch-model --from DIR` writes the name of the checkpoint it installed here, so that a
# learner who brings other weights gets them everywhere without setting anything.
CURRENT_MODEL_FILE = MODELS_DIR / "CURRENT"
MODEL_DIR_ENV = "AIE_MODEL_DIR"


def default_model_dir() -> Path:
    """The checkpoint every notebook, test and CLI command uses unless told otherwise.

    Precedence: the ``AIE_MODEL_DIR`` environment variable, then the checkpoint named in
    ``data/models/CURRENT``, then the course model (SmolLM2-135M-Instruct).
    """
    if os.environ.get(MODEL_DIR_ENV):
        return Path(os.environ[MODEL_DIR_ENV]).expanduser().resolve()
    if CURRENT_MODEL_FILE.exists():
        name = CURRENT_MODEL_FILE.read_text().strip()
        if name:
            return MODELS_DIR / name
    return MODELS_DIR / DEFAULT_MODEL_NAME
