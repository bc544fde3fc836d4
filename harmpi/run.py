"""``python -m harmpi.run``: the command's name; its code is harmpi.cli.run."""

if __name__ == "__main__":
    import sys

    from .cli.run import main

    sys.exit(main())
