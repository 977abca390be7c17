"""`python -m dumpstore`: the `dumpstore` command."""

from dumpstore.cli.main import run

if __name__ == "__main__":
    run()
