"""``text-generation-launcher`` wrapper: pick the model server with ``--backend paged|stock``.

The stock launcher has no flag naming the model server (it runs whatever ``text-generation-server``
``PATH`` finds) and rejects unknown flags, so the choice used to be the environment variable
``TGI_BACKEND`` alone. This console script is installed as ``text-generation-launcher`` next to our
``text-generation-server``; in the TGI image that is ``/usr/src/.venv/bin``, which the entrypoint puts
first on ``PATH``, ahead of the real launcher in ``/usr/local/bin``. It

1. removes ``--backend X`` / ``--backend=X`` from the arguments (before a ``--``, if any); without the
   flag it honours ``TGI_BACKEND``; either way the value must be ``paged`` or ``stock``, or it exits 2
   with one line naming the flag (or variable), the value and what is allowed;
2. exports the choice as ``TGI_BACKEND``, which the launcher passes on to every shard (our
   ``text-generation-server`` then serves, or execs TGI's own server for ``stock``);
3. with ``paged`` and LoRA adapters, keeps prefix caching on unless the user set ``PREFIX_CACHING``
   (:func:`keep_prefix_caching_with_lora`; the stock launcher would turn it off);
4. ``exec``s the real launcher, the next ``text-generation-launcher`` on ``PATH`` that is not a copy
   of this wrapper, with every other argument in order and the environment otherwise unchanged. The
   process is replaced (same pid), so signals reach the launcher directly and its exit code is the
   container's.

``-h`` / ``--help`` runs the real launcher's help and adds one entry for ``--backend``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tgi_paged_backend import envs
from tgi_paged_backend.config import ConfigError

LAUNCHER = "text-generation-launcher"
FLAG = "--backend"
MARKER = b"tgi_paged_backend"
"""Found in the first bytes of a console script of this package, never in the (Rust) launcher."""
HELP_ENTRY = (
    "\n      --backend <BACKEND>\n"
    "          Model server the shards run (tgi-paged-backend wrapper; removed before the launcher runs):\n"
    "          paged (tgi-paged-backend) or stock (TGI's own text-generation-server) "
    "[env: TGI_BACKEND=] [default: paged]\n"
)
EXIT_USAGE = 2
"""As clap, for a bad command line."""
EXIT_NOT_FOUND = 127
"""As a shell, for a command that is not on PATH."""


class UsageError(Exception):
    """A bad ``--backend`` / ``TGI_BACKEND``; the message names it, the value and what is allowed."""


def split_backend(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(value of --backend or None, the other arguments in order)``."""
    value: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg == FLAG or arg.startswith(FLAG + "="):
            if value is not None:
                raise UsageError(f"{FLAG} was given more than once: allowed once")
            if arg == FLAG:
                if i + 1 == len(argv):
                    raise UsageError(f"{FLAG} needs a value: allowed {' or '.join(envs.BACKENDS)}")
                value = argv[i + 1]
                i += 1
            else:
                value = arg[len(FLAG) + 1 :]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def choose_backend(flag_value: str | None, env: Mapping[str, str]) -> str:
    """The flag's value when given (``TGI_BACKEND`` is then ignored), else ``TGI_BACKEND``, else ``paged``."""
    try:
        if flag_value is not None:
            return envs.parse_backend(flag_value, FLAG)
        return envs.read_backend(env)
    except ConfigError as err:
        raise UsageError(str(err)) from None


def find_real_launcher(search_path: str, self_path: str | None) -> str | None:
    """The first executable ``text-generation-launcher`` on ``search_path`` that is neither
    ``self_path`` nor another copy of this wrapper."""
    for directory in search_path.split(os.pathsep):
        candidate = Path(directory or ".") / LAUNCHER
        if not (candidate.is_file() and os.access(candidate, os.X_OK)):
            continue
        if self_path is not None and _same_file(candidate, self_path):
            continue
        if _is_wrapper(candidate):
            continue
        return str(candidate)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns only on errors and for ``--help``."""
    args = list(sys.argv[1:] if argv is None else argv)
    environ = startup_environ()
    text_env = {os.fsdecode(k): os.fsdecode(v) for k, v in environ.items()}
    try:
        flag_value, rest = split_backend(args)
        backend = choose_backend(flag_value, text_env)
    except UsageError as err:
        print(f"{LAUNCHER}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    search_path = text_env.get("PATH", os.defpath)
    real = find_real_launcher(search_path, sys.argv[0] if sys.argv else None)
    if real is None:
        print(
            f"{LAUNCHER}: error: TGI's own {LAUNCHER} is not on PATH after this wrapper "
            f"({sys.argv[0]}); PATH={search_path}",
            file=sys.stderr,
        )
        return EXIT_NOT_FOUND
    environ[b"TGI_BACKEND"] = backend.encode()
    keep_prefix_caching_with_lora(rest, environ, backend)
    if _wants_help(rest):
        return _help(real, rest, environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(real, [LAUNCHER, *rest], environ)
    return 1  # not reached


def keep_prefix_caching_with_lora(args: Sequence[str], environ: dict[bytes, bytes], backend: str) -> bool:
    """Set ``PREFIX_CACHING=1`` for ``paged`` when LoRA adapters are given and ``PREFIX_CACHING`` is not.

    The stock launcher turns prefix caching off when ``--lora-adapters`` / ``LORA_ADAPTERS`` is set and
    the user did not set ``PREFIX_CACHING``, because TGI's own prefix cache ignores the adapter. Ours keys
    retained blocks by adapter (``memory.prefix_cache.chain_root``) and verifies content, so it stays on;
    the router's adapter-blind prefix matching only shapes its block booking, which this shard treats as
    virtual. A ``PREFIX_CACHING`` the user set always wins. Returns whether it set the variable.
    """
    if backend != "paged" or b"PREFIX_CACHING" in environ:
        return False
    options = list(args[: args.index("--")] if "--" in args else args)
    lora = b"LORA_ADAPTERS" in environ or any(
        a == "--lora-adapters" or a.startswith("--lora-adapters=") for a in options
    )
    if lora:
        environ[b"PREFIX_CACHING"] = b"1"
    return lora


def startup_environ() -> dict[bytes, bytes]:
    """The environment this process was started with, as bytes.

    Under the C locale Python adds ``LC_CTYPE=C.UTF-8`` to ``os.environ`` at start-up (PEP 538);
    ``/proc/self/environ`` (Linux) still holds exactly what the caller passed, so that is what the
    launcher gets. Elsewhere ``os.environb``.
    """
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environb)
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def _wants_help(args: Sequence[str]) -> bool:
    for arg in args:
        if arg == "--":
            return False
        if arg in ("-h", "--help"):
            return True
    return False


def _help(real: str, args: Sequence[str], environ: dict[bytes, bytes]) -> int:
    import subprocess

    code = subprocess.run([LAUNCHER, *args], env=environ, check=False, executable=real).returncode
    if code == 0:
        sys.stdout.write(HELP_ENTRY)
        sys.stdout.flush()
    return code


def _same_file(a: Path, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_wrapper(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(2048)
    except OSError:
        return False
    return head.startswith(b"#!") and MARKER in head


if __name__ == "__main__":
    sys.exit(main())
