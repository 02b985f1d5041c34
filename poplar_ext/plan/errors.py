"""`FormatError`, the one error of bad input files: ``source: field.path: expected X, found Y``."""

from __future__ import annotations


class FormatError(ValueError):
    """A profile, cluster description or plan that does not follow its schema.

    Attributes:
        source: the file (or other origin) the data came from.
        field: the dotted path of the offending field, e.g. ``samples[2].micro_batch_size``.
        expected: what the schema asks for.
        found: what was there instead.
    """

    def __init__(self, source: str, field: str, expected: str, found: str) -> None:
        self.source = source
        self.field = field
        self.expected = expected
        self.found = found
        super().__init__(f"{source}: {self.detail}")

    @property
    def detail(self) -> str:
        """The message without its source, for a list of problems that names the file once."""
        return f"{self.field}: expected {self.expected}, found {self.found}"
