"""Options shared by several commands."""

from __future__ import annotations

from pathlib import Path

import click

STORE_HELP = "Store folder (default: $DUMPSTORE_STORE or ./dumpstore_store)."


def store_option(fn):
    # no file_okay=False: a store path that is a file gets the library's one-line error, not click's usage text
    return click.option("--store", type=click.Path(path_type=Path), default=None, envvar="DUMPSTORE_STORE",
                        help=STORE_HELP)(fn)
