"""pb_utils' two error types, in a module of their own so that pb_utils and pb_metrics can both
raise them without importing each other."""
from shmserve.ipc.messages.common import ErrorCode


class TritonModelException(Exception):
    def message(self): return str(self.args[0]) if self.args else ""


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = str(message), int(code)

    def message(self): return self._message
    def code(self): return self._code
    def __repr__(self): return f"TritonError({self._message!r}, code={self._code})"
    __str__ = message


# TritonError's codes and the server's ErrorCode, both ways: a model's error response becomes a
# client's status, and a BLS answer's error becomes the model's TritonError
_PAIRS = ((TritonError.UNKNOWN, ErrorCode.UNKNOWN), (TritonError.INTERNAL, ErrorCode.INTERNAL),
          (TritonError.NOT_FOUND, ErrorCode.NOT_FOUND),
          (TritonError.INVALID_ARG, ErrorCode.INVALID_ARG),
          (TritonError.UNAVAILABLE, ErrorCode.UNAVAILABLE),
          (TritonError.UNSUPPORTED, ErrorCode.UNSUPPORTED),
          (TritonError.ALREADY_EXISTS, ErrorCode.ALREADY_EXISTS),
          (TritonError.CANCELLED, ErrorCode.CANCELLED))
TO_ERROR_CODE = dict(_PAIRS)
FROM_ERROR_CODE = {code: triton for triton, code in _PAIRS}
