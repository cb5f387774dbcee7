class PrepError(Exception):
    """A problem with the user's input or options: printed as one line, exit status 2."""
