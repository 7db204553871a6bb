"""Where one request's time goes, from the kernel's own clock: a timeline of every target's
requests at one caller, cut at the system calls that move the request and its first token
between the processes, with the thread hand-offs inside each target.

    python3 bench/timeline.py record DIR -- COMMAND...   # perf record -a while COMMAND runs
    python3 bench/timeline.py report DIR [--json OUT]    # the table of segments per target

`bash bench/run.sh timeline` runs both around the overhead scenario's one-caller level.

Why the kernel and not the driver's clock: the driver sees only its own sends and reads, and
strace (stop 48's timeline) stops a traced process at every system call, which inflates the
very hand-offs it is meant to time. `perf record` of the scheduler's and the system calls'
tracepoints costs about a microsecond an event and timestamps them all on one clock. The
events read are raw_syscalls (only the calls that move bytes or park a thread, filtered in
the kernel), sched:sched_waking and sched:sched_switch.

Which socket is which: while COMMAND runs, `record` reads /proc/PID/fd and /proc/net/tcp of
every process of COMMAND's tree every 100 ms and keeps, per (pid, fd), the socket's ports.
A connection's two ends are matched by their ports; the bench process (the load driver and
the fake provider in one) is COMMAND's root. One caller means one request at a time, so the
requests of one target never overlap and the cut points below are unambiguous:

    T0 driver writes the request        T4 the fake writes the first token (>= 25 ms after T3)
    T1 target reads it                  T5 target reads the first token
    T2 target writes the provider call  T6 target writes the first token to the driver
    T3 the fake reads it                T7 the driver reads it

For the provider called directly T1, T2, T5 and T6 do not exist. The added time to first
token is (T3 - T0) + (T7 - T4) of a target minus the same of the direct calls.
"""

import argparse
import bisect
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict

# x86_64 system call numbers.
READS = {0: "read", 19: "readv", 45: "recvfrom", 47: "recvmsg"}
WRITES = {1: "write", 20: "writev", 44: "sendto", 46: "sendmsg"}
PARKS = {7: "poll", 202: "futex", 232: "epoll_wait", 281: "epoll_pwait", 441: "epoll_pwait2"}
SYSCALLS = {**READS, **WRITES, **PARKS}
# The fake's first token comes 50 ms after the request; anything it writes sooner is the
# response's head.
FIRST_TOKEN_AFTER = 0.025
# CPU samples a second with `record --samples`: about two inside each of sluice's cuts at one
# caller.
SAMPLE_HZ = 5000


def tree(root):
    """The pids of `root` and its descendants."""
    parent = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            parent[int(name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    pids, i = [root], 0
    while i < len(pids):
        pids.extend(p for p, pp in parent.items() if pp == pids[i])
        i += 1
    return pids


def tcp_sockets():
    """inode -> (local port, remote port) of every IPv4/IPv6 TCP socket."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote, inode = cols[1], cols[2], int(cols[9])
                    if inode:
                        out[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return out


def snapshot(root, seen, out):
    socks = tcp_sockets()
    for pid in tree(root):
        try:
            # The program and its subcommand ("sluice serve", "sluice-bench pass-through").
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            comm = " ".join([os.path.basename(argv[0].decode())] + [a.decode() for a in argv[1:2]])
            fds = os.listdir(f"/proc/{pid}/fd")
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", link)
            if not m or int(m.group(1)) not in socks:
                continue
            inode = int(m.group(1))
            key = (pid, int(fd), inode)
            if key in seen:
                continue
            seen.add(key)
            lport, rport = socks[inode]
            out.write(json.dumps({"t": time.monotonic(), "pid": pid, "comm": comm, "fd": int(fd),
                                  "inode": inode, "lport": lport, "rport": rport}) + "\n")
            out.flush()


def record(args):
    os.makedirs(args.dir, exist_ok=True)
    ids = " || ".join(f"id == {n}" for n in sorted(SYSCALLS))
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-a", "-o", os.path.join(args.dir, "perf.data"),
         # perf's own writes of what it records would be recorded too, without end.
         "-e", "raw_syscalls:sys_enter", "--filter", ids, "--exclude-perf",
         "-e", "raw_syscalls:sys_exit", "--filter", ids, "--exclude-perf",
         "-e", "sched:sched_waking", "-e", "sched:sched_switch"]
        # CPU samples with their call stacks, for what runs inside each cut (report --profile).
        + (["-e", f"cpu-clock/freq={SAMPLE_HZ},call-graph=dwarf,stack-size=32768/"]
           if args.samples else []),
        stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf's buffers are mapped before the command starts
    cmd = args.command[1:] if args.command and args.command[0] == "--" else args.command
    child = subprocess.Popen(cmd)
    seen = set()
    with open(os.path.join(args.dir, "fds.jsonl"), "w") as out:
        out.write(json.dumps({"root": child.pid, "clock": time.clock_gettime(time.CLOCK_MONOTONIC)}) + "\n")
        while child.poll() is None:
            snapshot(child.pid, seen, out)
            time.sleep(0.1)
    perf.send_signal(signal.SIGINT)
    perf.wait()
    return child.returncode


LINE = re.compile(
    r"^\s*(?P<comm>.+?)\s+(?P<pid>-?\d+)/(?P<tid>\d+)\s+\[\d+\]\s+(?P<t>\d+\.\d+):\s+(?P<ev>\S+):\s*(?P<rest>.*)$")


def events(path):
    """(time, pid, tid, kind, detail) from `perf script`, in time order."""
    proc = subprocess.Popen(
        ["perf", "script", "-i", path, "-F", "comm,pid,tid,cpu,time,event,trace,ip,sym"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1 << 20)
    sample = None
    for line in proc.stdout:
        if sample is not None:
            # A CPU sample's call stack: one frame a line, leaf first, then a blank line.
            if line.strip():
                frame = line.split(None, 1)
                sample[4].append(frame[1].strip() if len(frame) > 1 else frame[0])
                continue
            yield sample
            sample = None
            continue
        m = LINE.match(line)
        if not m:
            continue
        t, pid, tid, ev, rest = float(m["t"]), int(m["pid"]), int(m["tid"]), m["ev"], m["rest"]
        if ev.startswith("cpu-clock"):
            sample = (t, pid, tid, "sample", [])
        elif ev == "raw_syscalls:sys_enter":
            nr = int(rest.split()[1])
            a = rest[rest.index("(") + 1 : rest.index(")")].split(", ")
            yield t, pid, tid, "enter", (nr, int(a[0], 16))
        elif ev == "raw_syscalls:sys_exit":
            parts = rest.split()
            yield t, pid, tid, "exit", (int(parts[1]), int(parts[3]))
        elif ev == "sched:sched_waking":
            woken = int(re.search(r"pid=(\d+)", rest).group(1))
            yield t, pid, tid, "waking", woken
        elif ev == "sched:sched_switch":
            prev = int(re.search(r"prev_pid=(\d+)", rest).group(1))
            nxt = int(re.search(r"next_pid=(\d+)", rest).group(1))
            yield t, pid, tid, "switch", (prev, nxt)
    proc.wait()


class Sockets:
    """Which connection each (pid, fd) is, and which process listens on which port."""

    def __init__(self, path):
        with open(path) as f:
            head = json.loads(next(f))
            self.root = head["root"]
            self.rows = [json.loads(line) for line in f]
        self.by_fd = {(r["pid"], r["fd"]): r for r in self.rows}
        self.comm = {r["pid"]: r["comm"] for r in self.rows}
        # A connection is (a port, b port); its ends are the rows with lport a, rport b and the
        # reverse.
        self.end = {(r["lport"], r["rport"]): r for r in self.rows}

    def peer(self, row):
        return self.end.get((row["rport"], row["lport"]))


def quantile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# The cut points of a request in order, with what each is. Over the broker the gateway (the
# process the driver calls) publishes the request (B1), the processor reads it (B2), the
# processor publishes the first token (B3) and the gateway reads it (B4).
MARKS = ["T0", "T1", "B1", "B2", "T2", "T3", "T4", "T5", "B3", "B4", "T6", "T7"]
SEGMENTS = [
    ("T0", "T1", "driver -> target"),
    ("T1", "T2", "target: request in -> provider call out"),
    ("T1", "B1", "  gateway: request in -> published"),
    ("B1", "B2", "  broker: gateway -> processor"),
    ("B2", "T2", "  processor: request -> provider call"),
    ("T2", "T3", "target -> fake"),
    ("T4", "T5", "fake -> target (first token)"),
    ("T5", "T6", "target: first token in -> out"),
    ("T5", "B3", "  processor: token -> published"),
    ("B3", "B4", "  broker: processor -> gateway"),
    ("B4", "T6", "  gateway: record -> caller"),
    ("T6", "T7", "target -> driver"),
]


def report(args):
    sockets = Sockets(os.path.join(args.dir, "fds.jsonl"))
    root = sockets.root
    # The fake's port: the root's local port shared by the most sockets (every connection it
    # accepted has it).
    root_rows = [r for r in sockets.rows if r["pid"] == root]
    lports = defaultdict(int)
    for r in root_rows:
        lports[r["lport"]] += 1
    fake_port = max(lports, key=lports.get)
    fake_fds = {r["fd"] for r in root_rows if r["lport"] == fake_port}
    # The driver's connections (the root's, to a listening port of a target or of the fake),
    # and per target process its client-side and provider-side sockets.
    drivers = {}
    for r in root_rows:
        peer = sockets.peer(r)
        if r["lport"] != fake_port and peer is not None:
            drivers[r["fd"]] = peer["pid"]
    client_fds, provider_fds, broker_fds = set(), set(), set()
    for r in sockets.rows:
        if r["pid"] == root:
            continue
        peer = sockets.peer(r)
        if r["rport"] == args.broker_port:
            broker_fds.add((r["pid"], r["fd"]))
        elif peer is not None and peer["pid"] == root:
            (provider_fds if peer["lport"] == fake_port else client_fds).add((r["pid"], r["fd"]))
    names = {}
    for pid in set(drivers.values()):
        names[pid] = "direct" if pid == root else sockets.comm.get(pid, str(pid))
    thread_pid = {}

    # One caller: one request in flight at a time, whichever target it is for.
    reqs = defaultdict(list)
    cur = None
    pending = {}
    sched = defaultdict(list)
    samples = defaultdict(list)  # pid -> [(t, tid, frames)]
    trail = defaultdict(list)  # pid -> [(t, tid, what)], for --show
    watched = {r["pid"] for r in sockets.rows if r["pid"] != root}

    def mark(name, t):
        if cur is not None and name not in cur:
            cur[name] = t

    for t, pid, tid, kind, detail in events(os.path.join(args.dir, "perf.data")):
        if pid > 0:
            thread_pid[tid] = pid
        if kind == "enter":
            nr, fd = detail
            pending[tid] = (nr, fd)
            if pid in watched:
                sched[pid].append((t, "sys", tid, nr))
                trail[pid].append((t, tid, f"{SYSCALLS.get(nr, nr)}(fd {fd})"))
            if nr not in WRITES:
                continue
            if pid == root and fd in drivers:
                # A request whose end was not seen does not hold up the next one.
                if cur is None or "T7" in cur or t - cur["T0"] > 1.0:
                    cur = {"T0": t, "target": drivers[fd], "driver_fd": fd}
                    reqs[cur["target"]].append(cur)
            elif cur is None:
                continue
            elif pid == root and fd in fake_fds:
                if "T3" in cur and fd == cur.get("fake_fd") and t - cur["T3"] >= FIRST_TOKEN_AFTER:
                    mark("T4", t)
            elif (pid, fd) in provider_fds and "T1" in cur:
                if "T2" not in cur:
                    cur["processor"] = pid
                mark("T2", t)
            elif (pid, fd) in client_fds and pid == cur["target"] and "T5" in cur:
                mark("T6", t)
            elif (pid, fd) in broker_fds:
                if pid == cur["target"] and "T1" in cur and "T2" not in cur:
                    mark("B1", t)
                elif pid != cur["target"] and "T5" in cur:
                    mark("B3", t)
        elif kind == "exit":
            got = pending.pop(tid, None)
            if got is None or cur is None:
                continue
            nr, fd = got
            if pid in watched:
                trail[pid].append((t, tid, f"  = {detail[1]}"))
            if nr not in READS or detail[1] <= 0:
                continue
            if pid == root and fd in fake_fds:
                if ("T2" in cur or cur["target"] == root) and "T3" not in cur:
                    cur["T3"], cur["fake_fd"] = t, fd
            elif pid == root and fd == cur["driver_fd"]:
                if "T4" in cur and ("T6" in cur or cur["target"] == root):
                    mark("T7", t)
            elif (pid, fd) in client_fds and pid == cur["target"]:
                mark("T1", t)
            elif (pid, fd) in provider_fds and pid == cur.get("processor") and "T4" in cur:
                mark("T5", t)
            elif (pid, fd) in broker_fds:
                if pid != cur["target"] and "B1" in cur and "T2" not in cur:
                    mark("B2", t)
                elif pid == cur["target"] and "B3" in cur:
                    mark("B4", t)
        elif kind == "sample":
            if pid in watched:
                samples[pid].append((t, tid, detail))
        elif kind == "waking":
            wp = thread_pid.get(detail)
            if wp in watched:
                sched[wp].append((t, "waking", detail, pid))
                trail[wp].append((t, tid, f"wakes thread {detail}"))
        elif kind == "switch":
            prev, nxt = detail
            for tid_, what in ((prev, "off"), (nxt, "on")):
                p = thread_pid.get(tid_)
                if p in watched:
                    sched[p].append((t, what, tid_, None))
                    trail[p].append((t, tid_, "on the CPU" if what == "on" else "off the CPU"))

    def inside(pids, a, b):
        """The processes' threads between a and b: CPU time, thread wake-ups (a thread woken to
        run) with their latency to the CPU, and system calls by name."""
        cpu, latency, calls = 0.0, [], defaultdict(int)
        for pid in pids:
            rows = sched[pid]
            times = [r[0] for r in rows]
            lo, hi = bisect.bisect_left(times, a), bisect.bisect_right(times, b)
            on_since, woken, seen = {}, {}, set()
            # A thread whose first event in the window is not being switched in was already
            # running at `a`.
            for t, kind, tid, extra in rows[lo:hi]:
                first = kind != "waking" and tid not in seen
                if kind != "waking":
                    seen.add(tid)
                if kind == "on":
                    on_since[tid] = t
                    if tid in woken:
                        latency.append(t - woken.pop(tid))
                elif kind == "off":
                    start = on_since.pop(tid, a if first else None)
                    if start is not None:
                        cpu += t - start
                elif kind == "waking":
                    woken[tid] = t
                elif kind == "sys":
                    if first:
                        on_since[tid] = a
                    calls[SYSCALLS.get(extra, str(extra))] += 1
            for since in on_since.values():
                cpu += b - since
        return cpu, latency, calls

    result = {"targets": []}
    direct = [r for r in reqs.get(root, []) if all(k in r for k in ("T0", "T3", "T4", "T7"))]
    direct_req = quantile([r["T3"] - r["T0"] for r in direct], .5)
    direct_resp = quantile([r["T7"] - r["T4"] for r in direct], .5)
    print(f"the provider called directly, {len(direct)} requests: driver -> fake "
          f"{us(direct_req)}, fake -> driver (first token) {us(direct_resp)} (p50)")
    result["direct"] = {"requests": len(direct), "request_p50_us": direct_req * 1e6,
                        "first_token_p50_us": direct_resp * 1e6}
    for pid in sorted(set(reqs) - {root}, key=lambda p: names.get(p, "")):
        need = ["T0", "T1", "T2", "T3", "T4", "T5", "T6", "T7"]
        done = [r for r in reqs[pid] if all(k in r for k in need)]
        if not done:
            print(f"\n{names.get(pid, pid)} (pid {pid}): no complete request of {len(reqs[pid])}")
            continue
        procs = {pid} | {r["processor"] for r in done}
        over_broker = all(k in r for r in done for k in ("B1", "B2", "B3", "B4"))
        added = quantile([(r["T3"] - r["T0"]) + (r["T7"] - r["T4"]) for r in done], .5) \
            - direct_req - direct_resp
        label = " + ".join(sockets.comm.get(p, str(p)) for p in sorted(procs))
        print(f"\n{label}, {len(done)} requests; time to first token added over the direct "
              f"calls, p50: {us(added)}")
        print(f"  {'segment':44} {'p50':>8} {'p90':>8}")
        out = {"name": label, "requests": len(done), "added_p50_us": added * 1e6, "segments": []}
        for a, b, name in SEGMENTS:
            if (a.startswith("B") or b.startswith("B")) and not over_broker:
                continue
            xs = [r[b] - r[a] for r in done]
            print(f"  {name:44} {us(quantile(xs, .5)):>8} {us(quantile(xs, .9)):>8}")
            out["segments"].append({"segment": name.strip(), "p50_us": quantile(xs, .5) * 1e6,
                                    "p90_us": quantile(xs, .9) * 1e6})
        for label_, a, b in (("request in -> provider call out", "T1", "T2"),
                             ("first token in -> out", "T5", "T6")):
            cpus, hops, lats, calls = [], [], [], defaultdict(list)
            for r in done:
                cpu, lat, c = inside(procs, r[a], r[b])
                cpus.append(cpu)
                hops.append(len(lat))
                lats.extend(lat)
                for k, v in c.items():
                    calls[k].append(v)
            per = {k: statistics.median(v + [0] * (len(done) - len(v))) for k, v in calls.items()}
            print(f"  inside '{label_}': CPU {us(quantile(cpus, .5))}, "
                  f"{statistics.median(hops):g} thread wake-ups of {us(quantile(lats, .5))} each "
                  f"(p50; p90 {us(quantile(lats, .9))}); system calls: "
                  + ", ".join(f"{k} {v:g}" for k, v in sorted(per.items()) if v))
            out["segments"].append({"inside": label_, "cpu_p50_us": quantile(cpus, .5) * 1e6,
                                    "wakeups_p50": statistics.median(hops),
                                    "wake_latency_p50_us": quantile(lats, .5) * 1e6,
                                    "wake_latency_p90_us": quantile(lats, .9) * 1e6,
                                    "syscalls_p50": per})
        if args.show is not None and args.show < len(done):
            r = done[args.show]
            for label_, a, b in (("request in -> provider call out", "T1", "T2"),
                                 ("first token in -> out", "T5", "T6")):
                print(f"  request {args.show}, '{label_}' ({us(r[b] - r[a])}), µs from its start:")
                rows = sorted(x for p in procs for x in trail[p] if r[a] <= x[0] <= r[b])
                for t, tid, what in rows:
                    print(f"    {(t - r[a]) * 1e6:7.1f}  thread {tid:<7} {what}")
        if args.profile:
            kept = []
            for label_, a, b in (("request in -> provider call out", "T1", "T2"),
                                 ("first token in -> out", "T5", "T6")):
                profile(label_, [(r[a], r[b]) for r in done], procs, samples, args.profile, kept)
            # Every sample inside the cuts, for questions the summary does not answer.
            with open(os.path.join(args.dir, f"samples-{pid}.json"), "w") as f:
                json.dump(kept, f)
        result["targets"].append(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def profile(label, windows, procs, samples, n, keep=None):
    """The functions most often on the stack of the CPU samples inside `windows` (inclusive:
    each function once a sample), and the leaves."""
    inclusive, leaves, total = defaultdict(int), defaultdict(int), 0
    for pid in procs:
        rows = samples[pid]
        times = [r[0] for r in rows]
        for a, b in windows:
            for _, _, frames in rows[bisect.bisect_left(times, a):bisect.bisect_right(times, b)]:
                total += 1
                names = [short(f) for f in frames]
                if keep is not None:
                    keep.append({"cut": label, "frames": names})
                if names:
                    leaves[names[0]] += 1
                for f in set(names):
                    inclusive[f] += 1
    print(f"  samples inside '{label}': {total} (in {len(windows)} requests, each sample "
          f"{1e6 / SAMPLE_HZ:.0f} µs of one CPU)")
    if not total:
        return
    print("    on the stack (inclusive):")
    for f, c in sorted(inclusive.items(), key=lambda kv: -kv[1])[:n]:
        print(f"      {100 * c / total:5.1f}%  {f}")
    print("    leaves (self):")
    for f, c in sorted(leaves.items(), key=lambda kv: -kv[1])[:n // 2]:
        print(f"      {100 * c / total:5.1f}%  {f}")


def short(frame):
    """A frame's function without its generic arguments (`poll<...>`) and offset; a
    qualified path (`<A as B>::f`) stays."""
    frame = re.sub(r"\+0x[0-9a-f]+$", "", frame)
    out, i = [], 0
    while i < len(frame):
        ch = frame[i]
        if ch == "<" and out and (out[-1].isalnum() or out[-1] == "_"):
            depth = 0
            while i < len(frame):
                depth += {"<": 1, ">": -1}.get(frame[i], 0)
                i += 1
                if depth == 0:
                    break
            continue
        out.append(ch)
        i += 1
    return "".join(out)[:160]


def us(seconds):
    return f"{seconds * 1e6:.0f} µs"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("dir")
    r.add_argument("--samples", action="store_true", help="also sample call stacks (for report --profile)")
    r.add_argument("command", nargs=argparse.REMAINDER)
    s = sub.add_parser("report")
    s.add_argument("dir")
    s.add_argument("--json")
    s.add_argument("--broker-port", type=int, default=6650)
    s.add_argument("--show", type=int, metavar="N",
                   help="print every event inside the cuts of each target's Nth request")
    s.add_argument("--profile", type=int, default=0, metavar="N",
                   help="the N functions most often on the stack of the samples inside each cut")
    args = p.parse_args()
    sys.exit(record(args) if args.cmd == "record" else report(args))


if __name__ == "__main__":
    main()
