"""The wheel carries model_configs/ (kept at the repository's top level, where users edit it) as
megatron_dapo/model_configs; an editable install reads the top-level folder itself (config/run_config.py)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithModelConfigs(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "megatron_dapo" / "model_configs"
        target.mkdir(parents=True, exist_ok=True)
        for yaml_file in sorted(Path(__file__).parent.joinpath("model_configs").glob("*.yaml")):
            shutil.copy2(yaml_file, target / yaml_file.name)


setup(cmdclass={"build_py": BuildPyWithModelConfigs})
