"""Members on hosts of their own, on one machine: a Linux network namespace per host, each with
one address on a bridge, and faults made with `ip`: a host's link down and up (a partition), a
blackhole route from one host to another (asymmetric: the rest still reach it).

Everything is made inside namespaces the harness creates: the bridge lives in a namespace of its
own (the switch), each host's veth pair runs from its namespace to the switch's, and the
addresses (SUBNET, a private /24) exist only there. Nothing touches the machine's own network.
close() removes every veth, the bridge and every namespace by the name it was made with, also
after a failure; processes are the caller's to stop first (Daemon.stop, by pid). A run killed
before close() leaves its namespaces: the next Hosts of the same tag removes them first."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from kvcache.launch import Daemon
from netns_programs import STATUS

SUBNET = "10.77.0"  # SUBNET.1 upward, one per host, on the bridge inside the switch namespace
_IP_TIMEOUT_S = 10.0


def why_no_namespaces() -> str | None:
    """None when this machine lets the tests make network namespaces, else why not."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    name = f"kvh{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT_S)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def remove_leftovers(tag: str) -> list[str]:
    """Namespaces named as this tag's (`TAG-sw`, `TAG-N`) that a killed run left, their processes
    killed by the pids `ip netns pids` gives, then removed by name; the names removed. Only this
    process's tag: a live run's namespaces have another."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT_S).stdout
    names = [line.split()[0] for line in listed.splitlines() if re.fullmatch(rf"{tag}-(sw|\d+)", line.split()[0])] \
        if listed.strip() else []
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT_S)
    return names


class Hosts:
    """Hosts by name, each in its own namespace with address SUBNET.N on one bridge."""

    def __init__(self, names: Sequence[str]):
        self.tag = f"kvh{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        self.namespaces: dict[str, str] = {}  # host name -> namespace name, in creation order
        self.ports: dict[str, str] = {}  # host name -> its veth end on the switch
        self.addresses: dict[str, str] = {}
        self._made: list[tuple[str, ...]] = []  # what close() removes, newest first
        self._faults: set[tuple[str, ...]] = set()  # partitions (host,) and cuts (host, peer) in force
        self._status_clients: dict[str, subprocess.Popen] = {}  # host -> its STATUS client, kept for the next polls
        remove_leftovers(self.tag)
        try:
            _ip("netns", "add", self.switch)
            self._made.append(("netns", "del", self.switch))
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._made.append(("-n", self.switch, "link", "del", "br0"))
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for index, name in enumerate(names):
                self._add(index, name)
        except BaseException:
            self.close()
            raise

    def _add(self, index: int, name: str) -> None:
        namespace, port = f"{self.tag}-{index}", f"s{index}"
        _ip("netns", "add", namespace)
        self._made.append(("netns", "del", namespace))
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
        self._made.append(("-n", self.switch, "link", "del", port))  # takes its pair, eth0, with it
        address = f"{SUBNET}.{index + 1}"
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        self.namespaces[name], self.ports[name], self.addresses[name] = namespace, port, address

    def close(self) -> None:
        """Stop the status clients (by pid), then remove what was made, by name, newest first; one
        failure does not stop the rest."""
        while self._status_clients:
            _, process = self._status_clients.popitem()
            process.kill()
            process.wait(10.0)
        errors = []
        while self._made:
            command = self._made.pop()
            try:
                _ip(*command)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("could not remove: " + "; ".join(errors))

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- members and clients ------------------------------------------------------

    def prefix(self, host: str) -> list[str]:
        """Run a command on `host`: ip execs it inside the namespace, so its pid is the command's."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def daemon(self, host: str, role: str, args: Sequence[str], log_path: Path, timeout_s: float = 60.0,
               wait: bool = True) -> Daemon:
        """`kvcache ROLE --host ADDRESS ARGS` on `host`; the caller stops it (by its pid). `wait=False`:
        its address once `started()` (several start at once)."""
        return Daemon(role, ["--host", self.addresses[host], *args], log_path=log_path, timeout_s=timeout_s,
                      prefix=self.prefix(host), wait=wait)

    def run_python(self, host: str, code: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(host), sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)

    def start_python(self, host: str, code: str, *args: str, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE) -> subprocess.Popen:
        """The same, left running: the caller waits for it (bounded) or kills it by its pid."""
        return subprocess.Popen([*self.prefix(host), sys.executable, "-c", code, *args], stdout=stdout,
                                stderr=stderr, text=True, stdin=stdin)

    def status(self, host: str, coordinator: str, timeout_s: float = 30.0) -> dict:
        """What `coordinator` says ({"epoch", "members"}, or {"error"} when it does not answer), asked
        from `host` by a STATUS client left running there (started on first use, killed by its pid
        on close): a poll then costs a call, not a Python and grpc start (~0.3 s of CPU each)."""
        process = self._status_clients.get(host)
        if process is None:
            process = self._status_clients[host] = self.start_python(host, STATUS, stdin=subprocess.PIPE,
                                                                     stderr=subprocess.DEVNULL)
        process.stdin.write(coordinator + "\n")
        process.stdin.flush()
        line = first_line(process, timeout_s)
        if not line:
            raise TimeoutError(f"the status client on {host} did not answer within {timeout_s:.0f} s")
        return json.loads(line)

    # ---- faults -----------------------------------------------------------------------

    def partition(self, host: str) -> None:
        """The host's link down at the switch: its packets go nowhere, nobody's reach it."""
        _ip("-n", self.switch, "link", "set", self.ports[host], "down")
        self._faults.add((host,))

    def heal(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.ports[host], "up")
        self._faults.discard((host,))

    def cut(self, host: str, peer: str) -> None:
        """Asymmetric: `host` sends nothing to `peer` (a blackhole route in host's namespace), so
        their connections fail both ways, while everyone else still reaches `host`."""
        _ip("-n", self.namespaces[host], "route", "add", "blackhole", f"{self.addresses[peer]}/32")
        self._faults.add((host, peer))

    def mend(self, host: str, peer: str) -> None:
        _ip("-n", self.namespaces[host], "route", "del", "blackhole", f"{self.addresses[peer]}/32")
        self._faults.discard((host, peer))

    def undo_faults(self) -> None:
        """Heal and mend whatever is still partitioned or cut (a test that ended early): a daemon
        stopped while its peers cannot reach it waits out its drain for calls they never end."""
        for fault in sorted(self._faults):
            if len(fault) == 1:
                self.heal(*fault)
            else:
                self.mend(*fault)


def members(hosts: Hosts, coordinator: str) -> dict[str, bool]:
    """What `coordinator` says of its members (address -> alive), asked from the host "client";
    {} when it does not answer."""
    return hosts.status("client", coordinator).get("members", {})


def epoch(hosts: Hosts, coordinator: str) -> str:
    """`coordinator`'s epoch, asked from the host "client"; "" when it does not answer."""
    return hosts.status("client", coordinator).get("epoch", "")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def first_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The next line `process` prints, waiting timeout_s at most ("" if none came whole). Read from
    its pipe a byte at a time: a buffered readline could take the lines after it too, where a
    later communicate() (which reads the pipe itself) would never see them."""
    deadline, line, pipe = time.monotonic() + timeout_s, b"", process.stdout.fileno()
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([pipe], [], [], remaining)[0]:
            return ""
        byte = os.read(pipe, 1)
        if not byte:  # it ended without finishing the line
            return ""
        line += byte
    return line.decode()


def answers(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def starter(hosts: "Hosts", running: contextlib.ExitStack, log_dir: Path):
    """`start(host, role, *args)`: a daemon on `host` logging to log_dir/HOST.log, stopped by its pid
    when `running` closes (also when the test fails), after every fault was undone. With
    `wait=False` its address comes with `started(*daemons)`, so daemons that need not wait for
    each other start at once."""
    daemons = contextlib.ExitStack()
    running.callback(daemons.close)
    running.callback(hosts.undo_faults)  # runs first: a stop then need not wait for a partitioned peer

    def start(host: str, role: str, *args: str, wait: bool = True) -> Daemon:
        daemon = hosts.daemon(host, role, args, log_path=log_dir / f"{host}.log", wait=wait)
        daemons.callback(daemon.stop, 10.0)
        return daemon

    return start


def started(*daemons: Daemon) -> list[Daemon]:
    """The daemons, once each serves (each bounded by its start timeout)."""
    for daemon in daemons:
        daemon.started()
    return list(daemons)
