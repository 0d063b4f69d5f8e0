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


# `make tsan` runs these tests against a ThreadSanitizer build: its shadow memory and
# slowdown (5-15x) make memory and latency bounds meaningless, so those few bounds are
# scaled by this; every behaviour is still checked.
SANITIZED = bool(os.environ.get("CHATCORE_SANITIZED"))
BOUND_SCALE = 20 if SANITIZED else 1
