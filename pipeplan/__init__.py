"""pipeplan: the command line and the one settings object shared by every process."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pipeplan")  # one source of truth: pyproject.toml
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
