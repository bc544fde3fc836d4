"""``python -m launch``: same as the ``harmpi-launch`` console script."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="python -m launch")
