"""User errors: one clear line, exit code 2.

Errors a user can cause (a wrong path, a bad flag, corrupt data) are raised as `UsageError` with a
message that names the fix. Entry points wrap their `main` in `exit_on_usage_error`, which prints the
message on one line and exits 2. Bugs are left to raise normally, with their traceback."""
import argparse
import functools
import sys


class UsageError(Exception):
    """Something the user can fix: the message says what to change."""


def write_line(line, stream=None):
    """line + newline to `stream` (default stdout) in one write: print() writes the text and the newline
    separately when the stream is unbuffered (PYTHONUNBUFFERED, as under torchrun), and two ranks sharing
    one pipe could then interleave their lines; one write of under 4 KB to a pipe is atomic."""
    stream = sys.stdout if stream is None else stream
    stream.write(line + "\n")
    stream.flush()


def print_error_line(line):
    """line + newline to stderr in one write (see write_line)."""
    write_line(line, sys.stderr)


def exit_on_usage_error(main):
    """Decorator for CLI entry points: UsageError -> `error: <message>` on stderr, exit code 2."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UsageError as e:
            message = " ".join(str(e).split())  # always exactly one line
            print_error_line(f"error: {message}")
            sys.exit(2)
    return wrapper


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse prints usage + error on two lines and exits 2; we raise one UsageError line instead."""

    def error(self, message):
        raise UsageError(f"{message} (see --help for the flags)")
