"""The installed kvcache's version, one fact read from the package's metadata (pyproject.toml), so
every part can report it without importing the `kvcache` command-line package above it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvcache")
except PackageNotFoundError:   # run from a checkout that was never installed
    __version__ = "0+unknown"
