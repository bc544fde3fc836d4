"""``python -m launch.build_native [--allow-fail]``: compile harmpi's native
entry point (harmpi.native) for the installed torch; ``make`` runs it.

With ``--allow-fail`` a failed build (no C++ compiler, say) exits 0: harmpi
then keeps its Python path and ``harmpi.info()["native"]`` says so.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    from harmpi import native

    try:
        path = native.build()
    except Exception as exc:  # the compiler's message is in exc
        print(f"harmpi native entry point not built; the Python path will be used: {exc}",
              file=sys.stderr)
        return 0 if "--allow-fail" in args else 1
    print(f"harmpi native entry point: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
