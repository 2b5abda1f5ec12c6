import os
import sys

if getattr(sys.modules.get("pymtrace"), "__file__", None) is None:
    # `python -m pymtrace` run from a directory holding a checkout called pymtrace/ (a test
    # VM syncing the project to /pymtrace, run from /), with an editable install: -m put the
    # current directory first on sys.path, so the checkout was imported as a namespace
    # package instead of the installed package (the editable finder comes after the path),
    # and every `from pymtrace import ...` failed with a traceback. Import the real package.
    shadows = {os.path.abspath(p) for p in sys.modules.pop("pymtrace").__path__}
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if os.path.abspath(os.path.join(p or ".", "pymtrace")) not in shadows]
    import pymtrace  # noqa: F401,E402

    sys.path[:] = saved

from pymtrace.cli import main  # noqa: E402

raise SystemExit(main())
