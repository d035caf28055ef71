"""Every file of the package that git tracks (code, the built-in model, its predictor, the prompt sets) is in the
wheel, the form in which `pip install .` installs it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile


def main(folder: str) -> int:
    wheels = sorted(pathlib.Path(folder).glob("expertflow-*.whl"))
    if len(wheels) != 1:
        print(f"check_wheel: expected one expertflow wheel in {folder}, found {len(wheels)}", file=sys.stderr)
        return 1
    inside = set(zipfile.ZipFile(wheels[0]).namelist())
    tracked = subprocess.run(["git", "ls-files", "expertflow"], capture_output=True, text=True,
                             check=True).stdout.split()
    missing = [name for name in tracked if name not in inside]
    if missing:
        print(f"check_wheel: {wheels[0].name} lacks {len(missing)} package files, e.g. {missing[:5]}; list them "
              "under [tool.setuptools.package-data] in pyproject.toml", file=sys.stderr)
        return 1
    print(f"check_wheel: {wheels[0].name} carries all {len(tracked)} package files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
