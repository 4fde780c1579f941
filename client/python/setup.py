"""Marks the wheel as platform-specific: it carries the prebuilt native
module _kvdepot (see pyproject.toml for how it is built)."""

from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True


setup(distclass=BinaryDistribution)
