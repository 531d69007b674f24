"""setuptools reads pyproject.toml for everything but the package list, which `packages.find` cannot express.

configs/ and recipes/ stay at the top level of the repository; pyproject's `package-dir` maps them to the
packages `rlkit.configs` and `rlkit.recipes`, so a wheel ships them inside `rlkit/` and an editable install
reads them from the checkout.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["rlkit", "rlkit.*"], exclude=["*.__pycache__"]),
        "rlkit.configs",
        *(f"rlkit.configs.{group}" for group in find_namespace_packages(where="configs")),
        "rlkit.recipes",
    ]
)
