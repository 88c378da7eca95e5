"""Start a real `radixserve serve` process on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    api_key: str | None
    log_path: str

    def client(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(
            base_url=self.url, headers=headers, timeout=kw.pop("timeout", 120), **kw
        )

    def children(self) -> list[int]:
        return child_pids(self.proc.pid)

    def stop(self, timeout: float = 30) -> int:
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout)
        deadline = time.time() + 10
        while any(alive(k) for k in kids) and time.time() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if alive(k)], "orphan child processes left behind"
        return rc

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def start_server(tmp_path, *args: str, api_key: str | None = None, timeout: float = 180) -> Server:
    port = free_port()
    cmd = ["serve", "--port", str(port), "--dtype", "float32", *args] + (
        ["--api-key", api_key] if api_key else []
    )
    return _launch(
        cmd,
        port,
        tmp_path / f"server-{port}.log",
        api_key,
        timeout,
        ready=lambda url: httpx.get(f"{url}/health", timeout=1).status_code == 200,
    )


def _launch(
    cmd: list[str], port: int, log_path, api_key: str | None, timeout: float, ready
) -> Server:
    """Run `radixserve <cmd>` until `ready(url)` holds; its output goes to `log_path`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", *cmd],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
    )
    server = Server(proc, f"http://127.0.0.1:{port}", api_key, str(log_path))
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"radixserve {cmd[0]} exited early:\n{server.log()}")
        try:
            if ready(server.url):
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError(f"radixserve {cmd[0]} did not come up:\n{server.log()}")


def wait_idle(client: httpx.Client, timeout: float = 20) -> dict:
    """Wait until no request runs or waits, then check the KV invariant (free + cached ==
    capacity, nothing held by running requests); the scheduler's stats at that point."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = client.get("/get_server_info").json()["stats"]
        if s["num_running"] == 0 and s["num_queued"] == 0 and s["kv_transfer_waiting"] == 0:
            assert s["free_slots"] + s["cached_slots"] == s["num_slots"], s
            assert s["running_slots"] == 0, s
            return s
        time.sleep(0.2)
    raise AssertionError(
        f"requests still running: {client.get('/get_server_info').json()['stats']}"
    )


def start_router(tmp_path, *args: str, timeout: float = 60) -> Server:
    """A real `radixserve router` process; ready when it answers HTTP at all."""
    port = free_port()
    return _launch(
        ["router", "--port", str(port), *args],
        port,
        tmp_path / f"router-{port}.log",
        None,
        timeout,
        ready=lambda url: httpx.get(f"{url}/list_workers", timeout=1) is not None,
    )


def ipc_folder(pid: int) -> str | None:
    """The private folder of the ZeroMQ sockets the process `pid` has bound (read from /proc):
    a test that SIGKILLs a server removes it, since the server no longer can."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and "/radixserve-" in fields[7]:
                return os.path.dirname(fields[7])
    return None
