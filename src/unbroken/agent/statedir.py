"""Which pipeline the agent labels endpoints for: the agent names each engine process by the
`unbroken up` whose run.json lists it, found through the state directory. `sudo unbroken
agent` runs as root, whose state directory is not the user's: follow SUDO_USER to theirs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["follow_state_dir"]


def follow_state_dir(explicit: Path | None) -> None:
    """Point UNBROKEN_STATE_DIR at `explicit`, or under sudo at the invoking user's state
    directory when root has no pipeline of its own and the user has one."""
    if explicit is not None:
        os.environ["UNBROKEN_STATE_DIR"] = str(explicit)
        return
    user = os.environ.get("SUDO_USER")
    if os.environ.get("UNBROKEN_STATE_DIR") or not user or os.geteuid() != 0:
        return
    import pwd

    from unbroken.config.paths import state_dir

    if (state_dir() / "run.json").exists():
        return
    try:
        home = Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        return
    theirs = home / ".local" / "state" / "unbroken"
    if (theirs / "run.json").exists():
        logging.getLogger("unbroken.agent").info("labelling the pipeline of %s (%s)", user, theirs)
        os.environ["UNBROKEN_STATE_DIR"] = str(theirs)
