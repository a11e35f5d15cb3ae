"""The one exception type that means "the client sent something wrong"."""


class InvalidInput(ValueError):
    """Bad request content. Model adapters turn it into a Triton INVALID_ARG error for that request only."""
