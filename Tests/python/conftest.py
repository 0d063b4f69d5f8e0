import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def chatcore_binary():
    path = os.environ.get("CHATCORE_BINARY") or str(ROOT / ".build" / "debug" / "chatcore")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no chatcore binary at {path}: run `swift build` (or `make test`)")
    return path


from bounds import BOUND_SCALE, SANITIZED  # noqa: E402,F401  (the tests import them from here)
