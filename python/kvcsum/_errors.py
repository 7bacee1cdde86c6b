"""The exceptions of failed calls: kvcsum.Error and one subclass per
kvcs_status."""

# --- Errors -------------------------------------------------------------------


class Error(Exception):
    """A kvcsum call failed: `status` (the kvcs_status value, a kvcsum.Status),
    `status_name` and `message` (kvcs_last_error, copied at once)."""

    def __init__(self, status: int, status_name: str, message: str):
        super().__init__(f"{status_name}: {message}")
        self.status = status
        self.status_name = status_name
        self.message = message


class InvalidArgument(Error, ValueError):
    """KVCS_ERR_INVALID_ARGUMENT."""


class OutOfBounds(Error, IndexError):
    """KVCS_ERR_OUT_OF_BOUNDS."""


class Unsupported(Error):
    """KVCS_ERR_UNSUPPORTED."""


class NotFound(Error, LookupError):
    """KVCS_ERR_NOT_FOUND."""


class Malformed(Error, ValueError):
    """KVCS_ERR_MALFORMED."""


class NotReady(Error):
    """KVCS_ERR_NOT_READY."""


class DeviceError(Error):
    """KVCS_ERR_DEVICE."""


class BufferTooSmall(Error):
    """KVCS_ERR_BUFFER_TOO_SMALL (the helpers here size buffers themselves)."""


class InternalError(Error):
    """KVCS_ERR_INTERNAL: a bug in kvcsum."""


_ERRORS = {
    1: InvalidArgument,
    2: OutOfBounds,
    3: Unsupported,
    4: NotFound,
    5: Malformed,
    6: NotReady,
    7: DeviceError,
    8: BufferTooSmall,
    9: InternalError,
}
