"""`kvcache bench versus-torch` without torch says how to get it; the engine never asks for torch.

The side-by-side itself needs torch and transformers (a bench extra, not in `make test`'s
environment): its figures are in docs/benchmarks.md with the command that gave them."""

import subprocess
import sys

import pytest

WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None   # `import torch` raises ImportError, as where it is not installed
from kvcache.cli import main
sys.exit(main(["bench", "versus-torch", "--model", "tiny"]))
"""

# Records every attempt to import torch or transformers (and refuses it), then serves a request.
ENGINE_ALONE = """
import sys
asked = []
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            asked.append(name)
            raise ImportError(name)
sys.meta_path.insert(0, Refuse())
import worker.daemon, kvnode.daemon, coordinator.daemon, gateway.app
from worker.engine.engine import Engine
from worker.model import load_model
engine = Engine(load_model("tiny"), kv_dtype="float32", page_tokens=16, num_blocks=16)
done = engine.generate([[1, 2, 3, 4, 5]], max_new_tokens=3)[0]
assert len(done.token_ids) == 3, done
print("asked:", asked)
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_without_torch_the_bench_names_the_make_target():
    result = run_python(WITHOUT_TORCH)
    assert result.returncode == 2, result.stderr
    assert "torch is not installed" in result.stderr and "make bench-torch-deps" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("option", ["--repeats", "--threads", "--batch", "--prompt-tokens"])
def test_counts_must_be_positive(option):
    result = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "versus-torch", option, "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "every count must be positive" in result.stderr


def test_the_engine_and_daemons_never_import_torch():
    result = run_python(ENGINE_ALONE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "asked: []"
