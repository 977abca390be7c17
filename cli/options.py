"""Options shared by several commands."""

from __future__ import annotations

from pathlib import Path

import click

STORE_HELP = "Store folder (default: $DUMPSTORE_STORE or ./dumpstore_store)."


def store_option(fn):
    # no file_okay=False: a store path that is a file gets the library's one-line error, not click's usage text
    return click.option(
        "--store", type=click.Path(path_type=Path), default=None, envvar="DUMPSTORE_STORE", help=STORE_HELP
    )(fn)


def _set_connect_timeout(ctx, param, value):
    """--connect-timeout goes to dumpstore.engine_ray (imported only when it differs from its default there)."""
    if value is not None and value != 10.0:
        from dumpstore import engine_ray

        engine_ray.CONNECT_TIMEOUT = float(value)
    return value


def engine_options(fn):
    """--engine local|ray, --address, --batch: where the work runs (see README, Ray)."""
    fn = click.option(
        "--batch",
        type=click.IntRange(min=1),
        default=None,
        help="--engine ray: (step, rank) units per Ray task (default: by cluster size, at most 32).",
    )(fn)
    fn = click.option(
        "--connect-timeout",
        type=click.FloatRange(min=0.1),
        default=10.0,
        show_default=True,
        expose_value=False,
        callback=_set_connect_timeout,
        help="--engine ray: seconds to reach the cluster named by --address before giving up with one line.",
    )(fn)
    fn = click.option(
        "--address",
        default=None,
        help="--engine ray: the cluster to join (e.g. auto, ray://head:10001; default: a local Ray).",
    )(fn)
    return click.option(
        "--engine",
        type=click.Choice(["local", "ray"]),
        default="local",
        show_default=True,
        help="local: processes on this machine; ray: tasks on a Ray cluster (pip install "
        "'dumpstore[ray]'; the store on a file system every node reaches).",
    )(fn)


def noise_ref_option(fn):
    """`--noise-ref R2`: a second reference run whose error against --ref is each tensor's noise band."""
    return click.option(
        "--noise-ref",
        default=None,
        metavar="RUN",
        help="A second reference run (a rerun with non-determinism, another device): each tensor's error "
        "against --ref widens its tolerance to 3x that measured noise.",
    )(fn)
