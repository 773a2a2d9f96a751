"""The tool's own error type."""


class ToolError(Exception):
    """A mistake of the tool's user (a bad option, a directory that is not what it should be),
    reported as one line ``checkpoint.py: error: ...``."""
