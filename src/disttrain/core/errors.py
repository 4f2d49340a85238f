"""The one user-error type and the process exit codes every layer shares.

Any layer raises `UserError` for a mistake the user can fix (a config key, a flag, a file);
the CLI prints its one-line message and exits with EXIT_USAGE. Nothing here imports torch.
"""

from __future__ import annotations

EXIT_USAGE = 2  # a user mistake: one line on stderr, nothing half-written
EXIT_HEALTH = 3  # a health check (non-finite values, diverged replicas) stopped the run
EXIT_STORAGE = 74  # EX_IOERR: the final or emergency checkpoint could not be saved (one line says where, why)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: emergency checkpoint written; launchers restart or requeue on it
EXIT_HANG = 124  # the hang watchdog fired


class UserError(ValueError):
    """A mistake in the config, the command line or an input file; the message is one line
    naming the key, the value and what is allowed."""


# Config mistakes are user errors; the old name stays for readability at config call sites.
ConfigError = UserError
