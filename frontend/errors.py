"""OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) with the HTTP status that matches it, and
Triton's errors mapped onto it: the server's own message for bad input, 404 for an unknown model, 503 when Triton
cannot take the request."""
from __future__ import annotations

from tritonclient.utils import InferenceServerException

TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
         503: "service_unavailable", 500: "server_error"}
TRITON_STATUS = {"INVALID_ARGUMENT": 400, "StatusCode.INVALID_ARGUMENT": 400, "400": 400,
                 "NOT_FOUND": 404, "StatusCode.NOT_FOUND": 404,
                 "UNAVAILABLE": 503, "StatusCode.UNAVAILABLE": 503, "StatusCode.RESOURCE_EXHAUSTED": 503}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def from_triton(error: InferenceServerException) -> OpenAIError:
    status = TRITON_STATUS.get(str(error.status()), 500)
    if status == 500 and "invalid input" in (error.message() or ""):  # an ensemble step's or BLS's lost code
        status = 400
    return OpenAIError(status, error.message() or str(error))
