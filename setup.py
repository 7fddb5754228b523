"""Build the compiled row path (applier/_rowpath.pyx) when Cython and a C compiler are at hand.

Everything else is in pyproject.toml. Without a compiler the build of the
extension is skipped with a warning and applier runs its pure-Python row path
(``applier --version`` says which one is in use).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that leaves the extension out, with a warning, where it cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler / headers: the pure-Python path is used
            print(f"warning: applier's compiled row path was not built ({exc}); the pure-Python path will be used")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - as in run()
            print(f"warning: {ext.name} was not built ({exc}); the pure-Python path will be used")


try:
    from Cython.Build import cythonize
except ImportError:  # building without Cython (it is in build-system.requires): the pure path
    extensions = []
else:
    extensions = cythonize([Extension("applier._rowpath", ["applier/_rowpath.pyx"])],
                           compiler_directives={"language_level": "3"}, quiet=True)

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
