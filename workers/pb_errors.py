"""pb_utils' two error types, in a module of their own so that pb_utils and pb_metrics can both
raise them without importing each other."""


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
