"""Holding processes to a share of a core (the nodes benchmark's "held" table): a cgroup of
their own with a CPU quota, so that on one machine each chatcore node, and PostgreSQL,
has the capacity of a small machine of its own. Needs root and the cgroup CPU controller
(cgroup v1's `cpu` hierarchy, or v2's `cpu.max`); `available()` says why not otherwise.
"""
import os
import time

V1 = "/sys/fs/cgroup/cpu"
V2 = "/sys/fs/cgroup"
# A short period: a process held to 0.2 core waits at most 16 ms for its next share,
# not the default 80 ms (which would show in every latency measured).
PERIOD_US = 20_000


def _root():
    if os.path.exists(os.path.join(V1, "cpu.cfs_quota_us")):
        return V1, 1
    try:
        with open(os.path.join(V2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return V2, 2
    except OSError:
        pass
    return None, 0


def available():
    """None when processes can be held here, else why not."""
    root, version = _root()
    if root is None:
        return "no cgroup CPU controller on this machine"
    probe = os.path.join(root, f"chatcore-bench-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as error:
        return f"cannot make a cgroup under {root} ({error.strerror}: run as root)"
    return None


class HeldBack:
    """Of the quota periods from its making to `terminate` (the nodes benchmark's
    `before_sends` hook ends it when the sends are answered) in which each of `groups` was
    runnable, the share in which it was held back: near 1, that group is the limit."""

    def __init__(self, groups):
        self.groups = groups
        self.before = [group.periods() for group in groups]
        self.shares = None

    def terminate(self):
        self.shares = []
        for group, (periods, throttled) in zip(self.groups, self.before):
            now = group.periods()
            self.shares.append((now[1] - throttled) / max(1, now[0] - periods))


class Held:
    """A cgroup holding the processes put in it to `cores` of CPU time (0.25: a quarter of
    one core), until `remove`. A process started with `preexec_fn=held.enter` is in it from
    its first instruction, its threads and children with it."""

    def __init__(self, cores):
        root, self.version = _root()
        self.path = os.path.join(root, f"chatcore-bench-{os.getpid()}-{time.monotonic_ns()}")
        if self.version == 2:
            try:
                with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
                    f.write("+cpu")
            except OSError:
                pass  # already on, or refused: mkdir's group then lacks cpu.max, and writing it fails below
        os.mkdir(self.path)
        quota = max(1000, int(cores * PERIOD_US))
        if self.version == 1:
            self._write("cpu.cfs_period_us", PERIOD_US)
            self._write("cpu.cfs_quota_us", quota)
        else:
            self._write("cpu.max", f"{quota} {PERIOD_US}")

    def _write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def enter(self):
        """Puts the calling process in (a `preexec_fn`)."""
        self.add(os.getpid())

    def add(self, pid):
        """Puts process `pid` in; False when it is gone."""
        try:
            self._write("cgroup.procs", pid)
            return True
        except ProcessLookupError:
            return False

    def periods(self):
        """(quota periods so far in which a process of the group was runnable, those in
        which the group used up its quota and was held back)."""
        with open(os.path.join(self.path, "cpu.stat")) as f:
            stat = dict(line.split() for line in f)
        return int(stat["nr_periods"]), int(stat["nr_throttled"])

    def remove(self):
        """Removes the group once its processes are gone (each waited for first)."""
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
