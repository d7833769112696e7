"""The vLLM tests (`make test-vllm`): real vLLM engines on this CPU beside a real kvcache cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The default model as a Hugging Face folder: $KVCACHE_VLLM_MODEL (make test-vllm writes it once), else made here."""
    given = os.environ.get("KVCACHE_VLLM_MODEL")
    if given and (Path(given) / "config.json").is_file():
        return Path(given)
    folder = tmp_path_factory.mktemp("model") / "smollm2-135m"
    subprocess.run([sys.executable, "-m", "kvcache.cli", "export-hf", str(folder)], check=True, timeout=300)
    return folder
