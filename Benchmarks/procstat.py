"""CPU time of processes and threads, from /proc (the engine and nodes benchmarks)."""
import os


def stat_seconds(path):
    """The name and the CPU time (user + system) so far of the process or thread whose
    /proc stat file is `path`; ("", 0) when it is gone."""
    try:
        with open(path) as f:
            name, fields = f.read().split("(", 1)[1].rsplit(")", 1)
        fields = fields.split()
        return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return "", 0.0


def cpu_seconds(pids):
    """CPU time (user + system) the processes `pids` used so far."""
    return sum(stat_seconds(f"/proc/{pid}/stat")[1] for pid in pids)


def thread_seconds(pid, name):
    """CPU time (user + system) the threads of process `pid` named `name` used so far."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    return sum(seconds for thread, seconds in (stat_seconds(f"/proc/{pid}/task/{task}/stat") for task in tasks) if thread == name)
