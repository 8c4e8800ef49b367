"""The local pipeline (`unbroken up`): a supervisor that runs engines and the gateway as
processes, registers engines with the gateway over its admin API, and replaces the dead."""

from unbroken.config.paths import RunInfo, admin_token, state_dir
from unbroken.pipeline.supervisor import Supervisor

__all__ = ["RunInfo", "Supervisor", "admin_token", "state_dir"]
