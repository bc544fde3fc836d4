"""harmpi's build step: the optional torch extension harmpi._C (harmpi/_native.cpp).

The project's metadata is in pyproject.toml; setuptools reads both. The
extension is built with torch's extension tooling when torch is importable
at build time (``pip install -e . --no-build-isolation``, which make runs,
or ``pip install . --no-build-isolation``) and a C++ compiler works. Without
either the install still succeeds, says why in one line, and harmpi runs its
Python path (``harmpi.info()["native"]`` says so). The torch version built
against is compiled into the module; harmpi.native refuses it under another
torch.
"""

import sys

from setuptools import setup

NOT_BUILT = ("harmpi: the torch extension harmpi._C is not built ({}); harmpi.allreduce keeps "
             "its Python path and torch.ops.harmpi.all_reduce_ is unavailable")


def _native():
    """setup() arguments for harmpi._C, or none when torch is not importable."""
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

    ext = CppExtension("harmpi._C", ["harmpi/_native.cpp"],
                       define_macros=[("HARMPI_TORCH_VERSION", f'"{torch.__version__}"')],
                       extra_compile_args=["-g0"])  # no debug info: 0.3 MB, not 11
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_native())
