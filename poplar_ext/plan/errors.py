"""`FormatError`, the one error of bad input files: ``source: field.path: expected X, found Y``.
See profiles/README.md."""

from __future__ import annotations


class FormatError(ValueError):
    """A file that does not follow its schema: its `source`, the dotted path of the `field`
    (``samples[2].micro_batch_size``), what the schema `expected` and what was `found`."""

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


class WrongFormatError(FormatError):
    """A file of another of the project's formats where one format is read (a profile given as the cluster):
    `expected` names the format read, `found` the one the file is (`poplar_ext.plan.kinds`)."""
