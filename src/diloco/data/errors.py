"""The one error type the data layer shows to users."""


class CorpusError(ValueError):
    """A corpus problem the user can fix (bad path, empty text, failed fetch).

    The message is one actionable line; the CLI prints it and exits with status 2, so
    callers should raise this instead of letting OS or network errors escape.
    """
