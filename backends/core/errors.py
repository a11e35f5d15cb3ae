"""The one exception type that means "the client sent something wrong", and how it crosses BLS calls."""

# Triton 2.51 BLS responses lose the error code (every error arrives as INTERNAL), so client errors carry this
# prefix in their message; a BLS caller that sees it passes the error on as INVALID_ARG.
INVALID_INPUT_PREFIX = "invalid input: "


class InvalidInput(ValueError):
    """Bad request content. Model adapters turn it into a Triton INVALID_ARG error for that request only."""

    def __str__(self) -> str:
        return INVALID_INPUT_PREFIX + super().__str__()


def is_client_error(message: str) -> bool:
    return message.startswith(INVALID_INPUT_PREFIX)


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault (never in production: needs MM_FAULT_INJECTION=1)."""


class Unavailable(RuntimeError):
    """The server cannot take this request now (a capacity is reached); Triton's UNAVAILABLE, for that request only."""


class NotFound(InvalidInput):
    """The request names something this model does not have (an adapter): Triton's NOT_FOUND."""
