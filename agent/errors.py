"""torchrevive's errors: each message names the file, key or endpoint and says what to do."""


class TorchreviveError(Exception):
    """Base of every error torchrevive raises on purpose."""


class RestoreError(TorchreviveError):
    """A snapshot cannot be restored into the given state (missing, damaged, or of another model)."""


class SnapshotUnreadableError(RestoreError):
    """A snapshot cannot be read now for a reason that is not damage (an I/O error that may pass,
    or a record in a format this version does not know): it is never quarantined."""


class StaleRoundError(TorchreviveError):
    """A leader of a rendezvous round older than the job's newest tried to act for the job."""
