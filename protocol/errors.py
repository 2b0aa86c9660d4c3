"""The one exception the protocol raises."""


class ProtocolError(ValueError):
    """A frame or message that does not follow the protocol.

    Decoders raise this and nothing else, whatever bytes they are given.
    `code` is what a server answers with (see protocol.kinds.ERROR_CODES).
    """

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code
