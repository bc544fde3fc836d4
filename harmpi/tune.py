"""``python -m harmpi.tune``: the command's name; its code is harmpi.cli.tune."""

if __name__ == "__main__":
    import sys

    from .cli.tune import main

    sys.exit(main())
