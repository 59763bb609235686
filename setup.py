"""Build hook: ship the repository's recipes/ and calibration/ folders inside the quantkit package.

Everything else is declared in pyproject.toml. The top-level folders stay the one copy kept in git (users
browse them there, the docs and bench scripts name them by those paths); a wheel gets them as
quantkit/recipes and quantkit/calibration, where quantkit.shipped.shipped_dir looks first. MANIFEST.in puts
them in the sdist, so a wheel built from the sdist has them too.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

# Kept equal to quantkit.shipped.SHIPPED (the package cannot be imported here: its dependencies may be absent).
SHIPPED = ("recipes", "calibration")


class build_py_with_shipped(build_py):
    def run(self):
        super().run()
        # An editable install reads the checkout's folders directly; copying there would only add stale copies.
        if getattr(self, "editable_mode", False):
            return
        for name in SHIPPED:
            self.copy_tree(name, os.path.join(self.build_lib, "quantkit", name))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        for name in SHIPPED:
            for folder, _, files in os.walk(name):
                outputs += [os.path.join(self.build_lib, "quantkit", folder, f) for f in files]
        return outputs


setup(cmdclass={"build_py": build_py_with_shipped})
