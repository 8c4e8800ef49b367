"""The supervisor's control socket client, for the pipeline's own callers: it lives in
`unbroken.clients` (the controller and the benchmarks use it too, and may not import the
pipeline); its server is `pipeline/control_api.py`."""

from unbroken.clients import (
    SupervisorClient,
    SupervisorError,
    SupervisorRejected,
    SupervisorUnreachable,
)

__all__ = ["SupervisorClient", "SupervisorError", "SupervisorRejected", "SupervisorUnreachable"]
