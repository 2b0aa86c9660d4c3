"""Exceptions of the sidecar."""


class OnboxError(Exception):
    """Base of the sidecar's own errors; the message is shown to the user."""


class ConfigError(OnboxError):
    """Bad options: a refused bind address, a missing key file, a bad run dir."""


class AlreadyServing(OnboxError):
    """Another sidecar holds this run's lock."""
