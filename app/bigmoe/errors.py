"""The app's error base: anything raised as BigmoeError is shown as one line, exit code 1 unless it says another."""

from bigmoe import exit_codes


class BigmoeError(Exception):
    """An error the user can act on; its message is one line."""

    exit_code = exit_codes.ERROR
