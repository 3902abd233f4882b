"""pipeplan: the command line and the one settings object shared by every process."""

__version__ = "0.1.0"
