"""``python -m dcomm.ddp.build``: build dcomm's C++ DDP hooks ahead of time (images, CI).

Builds the C++ hooks of :func:`dcomm.ddp.register_comm_hook` for this torch installation and
Python version, or finds them built, and prints where they are cached (``TORCH_EXTENSIONS_DIR``,
else torch's default). Exits 0 when they load, 1 with the cause and its fix when they cannot be
built here. A job that finds them built loads them in well under a second, without a compiler.

Example::

    $ TORCH_EXTENSIONS_DIR=/opt/torch_extensions python -m dcomm.ddp.build
    dcomm.ddp: the C++ DDP hooks are ready in /opt/torch_extensions/dcomm_ddp_native_.../....so
"""

from __future__ import annotations

import sys

from dcomm.ddp.native_hooks import NativeBuildError, load_native_hooks, native_hooks_file

__all__ = ["main"]


def main() -> int:
    """Build (or load) the C++ DDP hooks; print where they are; 0 on success, 1 with the cause.

    Example::

        >>> main()  # doctest: +SKIP
        0
    """
    try:
        load_native_hooks()
    except NativeBuildError as error:
        print(f"dcomm.ddp: {error}", file=sys.stderr)
        return 1
    print(f"dcomm.ddp: the C++ DDP hooks are ready in {native_hooks_file()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
