"""The trainer side's one error type (re-exported by :mod:`.client`)."""


class WeightPushError(RuntimeError):
    """The engine refused or failed a weight update (or the client refused to send it)."""
