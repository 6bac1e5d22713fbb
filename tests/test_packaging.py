"""The package's own metadata installs without deprecation noise from setuptools."""

from __future__ import annotations

import warnings

from conftest import REPO
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution


def test_pyproject_gives_setuptools_nothing_to_warn_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distribution = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert distribution.get_name() == "torchrevive" and distribution.metadata.license_expression == "BSD-3-Clause"
