"""The one exception type for user mistakes: it is reported as one line, never as a traceback."""


class UserError(Exception):
    """Bad configuration or input data; the message names the key, or the file and line."""
