"""``python -m harmpi.report``: the command's name; its code is harmpi.cli.report."""

if __name__ == "__main__":
    import sys

    from .cli.report import main

    sys.exit(main())
