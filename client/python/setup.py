"""Marks the wheel as platform-specific: it carries the prebuilt native
module _kvdepot (see pyproject.toml for how it is built). pip never compiles
it, so a tree without it (client/python itself, before the module is copied
in) is refused here rather than packaged into a wheel that cannot import."""

import glob
import os

from setuptools import setup
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))

if not glob.glob(os.path.join(HERE, "kvdepot", "_kvdepot*.so")):
    raise SystemExit(
        f"kvdepot: no native module kvdepot/_kvdepot*.so in {HERE}. pip does "
        "not compile it: build it with CMake (ninja -C <build> _kvdepot) and "
        "install from <build>/python, where the build puts it with this "
        "package (see README.md, 'Installing')."
    )


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True


setup(distclass=BinaryDistribution)
