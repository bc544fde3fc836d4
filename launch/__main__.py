"""``python -m harmpi_launch`` (installed) or ``python -m launch`` (a checkout):
the same as the ``harmpi-launch`` console script."""

from .cli import main

if __name__ == "__main__":
    main(prog_name=f"python -m {__package__}")
