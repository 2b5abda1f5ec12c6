"""The traced process as /proc shows it: liveness and exit status (one definition each)."""


def alive(pid):
    """Whether PID exists and is neither a zombie nor dead (a zombie's memory is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def exit_status(code):
    """A child's status as a shell reports it: its exit code, or 128 + the killing signal."""
    if code is None:
        return 0
    return code if code >= 0 else 128 - code
