"""``sbp`` starts quickly: parsing (and ``--help``) loads neither trio nor the
commands, a command loads only what it needs, and Ctrl-C while the modules
load is one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.procs import _child_env


def loaded_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after ``code``."""
    script = (
        "import sys\n"
        f"{code}\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_child_env(),
        timeout=60, check=True,
    )  # fmt: skip
    return set(result.stdout.split())


def test_help_and_parsing_load_neither_trio_nor_the_commands() -> None:
    loaded = loaded_after(
        "from client.cli import build_parser\n"
        "args = build_parser().parse_args(['streams', 'list'])\n"
        "try:\n"
        "    build_parser().parse_args(['--help'])\n"
        "except SystemExit:\n"
        "    pass"
    )
    assert not loaded & {"trio", "numpy", "prometheus_client", "ssl", "lmdb"}


def test_a_command_that_reads_no_records_loads_no_numpy_or_metrics() -> None:
    loaded = loaded_after("import client.cli_run, client.cli_commands, client.top")
    assert "trio" in loaded
    assert not loaded & {"numpy", "prometheus_client", "lmdb", "httpx"}


def test_ctrl_c_while_the_command_loads_is_one_line() -> None:
    """SIGINT raised exactly while ``client.cli_run`` imports trio. SIGINT
    is made the terminal's default first: a process started from a
    background job inherits it ignored, and Python then never raises
    KeyboardInterrupt."""
    script = (
        "import builtins, os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from client.cli import main\n"
        "real_import = builtins.__import__\n"
        "def importing(name, *args, **kwargs):\n"
        "    if name == 'trio':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = importing\n"
        "sys.exit(main(['--pm', '127.0.0.1:1', 'streams', 'list']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_child_env(),
        timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 130
    assert result.stderr == "sbp: interrupted\n"
