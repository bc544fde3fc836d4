"""harmpi's build step: the optional torch extension harmpi._C (harmpi/_native.cpp).

The project's metadata is in pyproject.toml; setuptools reads both. The
extension is built with torch's extension tooling when torch is importable
at build time (``pip install -e . --no-build-isolation``, which make runs,
or ``pip install . --no-build-isolation``) and a C++ compiler works. Without
either the install still succeeds, says why in one line, and harmpi runs its
Python path (``harmpi.info()["native"]`` says so). The torch version built
against is compiled into the module; harmpi.native refuses it under another
torch. ``HARMPI_NATIVE=0`` at build time skips it (as it skips it at run time).

Packages: harmpi and its subpackages, and the launcher, which lives in the
repository's ``launch/`` (``python -m launch`` in a checkout) and installs
as ``harmpi_launch`` (``python -m harmpi_launch``, ``harmpi-launch``): no
top-level name as common as ``launch`` lands in site-packages, and the
launcher still starts without importing harmpi (``import harmpi.launch``
would run harmpi/__init__.py: MPI, numba, torch, seconds). ``bench/`` is not
installed: its modules import each other as ``bench.*``; run them from a
checkout (``python -m bench.osu_allreduce``).
"""

import os
import sys

from setuptools import find_packages, setup

NOT_BUILT = ("harmpi: the torch extension harmpi._C is not built ({}); harmpi.allreduce keeps "
             "its Python path and torch.ops.harmpi.all_reduce_ is unavailable")


def _native():
    """setup() arguments for harmpi._C, or none when torch is not importable."""
    if os.environ.get("HARMPI_NATIVE") == "0":
        print(NOT_BUILT.format("HARMPI_NATIVE=0"), file=sys.stderr)
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        if not {"egg_info", "dist_info"} & set(sys.argv[1:]):  # once: when building
            print(NOT_BUILT.format(f"torch is not importable at build time: {exc}"),
                  file=sys.stderr)
        return {}

    class OptionalBuildExtension(BuildExtension):
        """torch's BuildExtension, except that a failed build (no compiler,
        say) leaves the install going without the extension."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # compiler missing or failing: reported, then go on
                why = str(exc).strip().splitlines() or [type(exc).__name__]
                print(NOT_BUILT.format(f"build failed: {why[-1]}; pip install -v shows the "
                                       "compiler's output"), file=sys.stderr)

        def copy_file(self, infile, outfile, *args, **kwargs):
            # the in-place copy of an editable install: a new file, not the old
            # one rewritten under ranks that have it mapped (that would crash them)
            if os.path.isfile(outfile):
                os.unlink(outfile)
            return super().copy_file(infile, outfile, *args, **kwargs)

    ext = CppExtension("harmpi._C", ["harmpi/_native.cpp"],
                       define_macros=[("HARMPI_TORCH_VERSION", f'"{torch.__version__}"')],
                       extra_compile_args=["-g0"])  # no debug info: 0.3 MB, not 11
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


PACKAGES = {
    "packages": [*find_packages(include=["harmpi", "harmpi.*"]), "harmpi_launch", "harmpi_vllm"],
    "package_dir": {"harmpi_launch": "launch"},
}

setup(**PACKAGES, **_native())
