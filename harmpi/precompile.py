"""``python -m harmpi.precompile``: the command's name; its code is harmpi.cli.precompile."""

if __name__ == "__main__":
    import sys

    from .cli.precompile import main

    sys.exit(main())
