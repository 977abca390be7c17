"""`python -m dumpstore`: the `dumpstore` command."""

from dumpstore.cli.main import run  # type: ignore[import-not-found]  # cli/ is installed as dumpstore.cli

if __name__ == "__main__":
    run()
