"""One exception type for mistakes the user can fix; the CLI turns it into one line and exit code 2."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""

    exit_code = 2
