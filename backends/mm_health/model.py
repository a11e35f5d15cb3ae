"""`mm_health`: Triton backend for `health`, the deep health check probes call (`python -m client.health`).

One request runs every check of backends.core.health and answers `status`, the report as JSON; unhealthy is a
normal response (the report says why), so a probe can print it. The optional input `fail` (honoured only where the
server runs with fault injection, for tests) names a check that reports failure.
"""
from __future__ import annotations

import json

import numpy as np

from backends.core.adapter import TritonBackend
from backends.core.errors import InvalidInput
from backends.core.health import CHECKS, HealthParams, report


class TritonPythonModel(TritonBackend[HealthParams]):
    Params = HealthParams
    recent: dict[str, tuple[float, dict]]  # the device checks' latest results (see backends.core.health.report)

    def setup(self) -> None:
        self.recent = {}
        report(self.params, recent=self.recent)  # the first probe must not pay for torch's and NVML's start-up

    def execute(self, requests: list) -> list:
        return [self.answer(request) for request in requests]

    def answer(self, request):
        try:
            self.check_parameters(request)
            fail = self.inputs(request).text("fail")
            if fail is not None and not self.faults_enabled:
                raise InvalidInput("input `fail` is for tests: this server runs without fault injection")
            if fail is not None and fail not in CHECKS:
                raise InvalidInput(f"fail: {fail!r} is not a check; checks are {list(CHECKS)}")
            status = json.dumps(report(self.params, fail, recent=self.recent)).encode()
            return self.pb.InferenceResponse([self.pb.Tensor("status", np.array([status], dtype=np.object_))])
        except Exception as e:
            return self.error_response(e)
