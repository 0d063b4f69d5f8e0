"""How far the few memory and time bounds of the tests stretch in this build.

`make tsan` runs the tests against a ThreadSanitizer build: its shadow memory and slowdown
(5-15x) make memory and latency bounds meaningless, so those few bounds are scaled by
BOUND_SCALE; every behaviour is still checked. Both conftests (Tests/python and
Tests/postgres, whose runs import Tests/python's test modules) export these names.
"""

import os

SANITIZED = bool(os.environ.get("CHATCORE_SANITIZED"))
BOUND_SCALE = 20 if SANITIZED else 1
