"""Warm ``zaya-pretrain`` launches for the test suite: torch imported once per test worker, not once per launch.

A launch spends some 7 s of a 2-core CI machine importing torch and Megatron, more than most CLI tests train.
Each test worker therefore keeps one *zygote*: a process that imported :data:`PRELOAD` and forks each launch
from there. The test runs a small client (``python warm_launch.py client SOCKET ARGS...``, standard library only)
in place of ``python -m megatron_zaya.pretrain ARGS...``; the client hands the zygote its standard streams,
environment and working directory, forwards the signals it gets to the forked launch, and exits as the launch
exited (its code, or killed by the same signal). A client that dies (a test's timeout) takes its launch along.

What a forked launch sees is what a fresh one sees, or the launch is not forked:
- The zygote imports only modules that every launch imports before anything of its own runs, and only if
  importing them printed and warned nothing (else it does not start, and every launch is a fresh process).
- A launch whose environment differs from the zygote's in anything but :data:`RUN_TIME_ENV` starts fresh: its
  environment could change what the imports did (``OMP_NUM_THREADS``, fault hooks on ``PYTHONPATH``, ...).
- The forked launch gets the client's streams, environment, directory, ``sys.argv`` and ``sys.path[0]`` as
  ``python -m`` sets them, runs the module as ``__main__``, and ends with the interpreter's own exit (its exit
  handlers, non-daemon threads and finalisation). Python reseeds ``random`` in a forked child; nothing in the
  zygote started a thread, a CUDA context or an OpenMP pool.
Launches under torchrun, and tests that read the start-up output or signal the process themselves, start it
fresh (``zaya_cli.pretrain(..., warm=False)``).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("torch", "torch.distributed.tensor", "numpy")
# Read only at run time, never by the preloaded imports: a launch may set them and still be forked (pytest sets
# PYTEST_CURRENT_TEST in its workers' environment for each test).
RUN_TIME_ENV = frozenset({"PYTEST_CURRENT_TEST"})
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
HEADER = struct.Struct("!I")


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = connection.recv(1 << 16)
        if not more:
            raise ConnectionError("the client left before its request was whole")
        data += more
    return json.loads(data[HEADER.size:]), fds


def _serve(path: str) -> dict:
    """The zygote's loop: fork a launch per request; tell each client its launch's pid, then how it ended.
    Returns (in the forked child only) the request to run. Ends the process when its test worker is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(wake_read, selectors.EVENT_READ, "exited")
    selector.register(sys.stdin, selectors.EVENT_READ, "worker")
    clients: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "worker" and not sys.stdin.buffer.read1(1):  # the test worker is gone
                for pid in clients:
                    os.kill(pid, signal.SIGKILL)
                os._exit(0)
            elif key.data == "request":
                connection, _ = listener.accept()
                try:
                    request, fds = _receive(connection)
                except (ConnectionError, ValueError):
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the launch: nothing of the zygote's but its imports
                    selector.close()
                    for sock in (listener, connection, *clients.values()):
                        sock.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_read)
                    os.close(wake_write)
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                connection.sendall(f"{pid}\n".encode())
                clients[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            elif key.data == "exited":
                os.read(wake_read, 4096)
                while clients:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    connection = clients.pop(pid)
                    if connection in (key.fileobj for key in selector.get_map().values()):
                        selector.unregister(connection)
                    ended = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                             else f"exit {os.WEXITSTATUS(status)}")
                    try:
                        connection.sendall(f"{ended}\n".encode())
                    except OSError:
                        pass
                    connection.close()
            elif isinstance(key.data, int) and not key.fileobj.recv(1):  # its client died: so does the launch
                selector.unregister(key.fileobj)
                os.kill(key.data, signal.SIGKILL)


def _zygote(path: str) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for module in PRELOAD:
            __import__(module)
    if caught:
        print(f"not forking launches: importing {PRELOAD} warned: {caught[0].message}", file=sys.stderr)
        sys.exit(1)
    request = _serve(path)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]
    sys.argv = ["-m", *request["args"]]
    import runpy

    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _client(path: str, module: str, args: list[str]) -> None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    payload = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(connection, [HEADER.pack(len(payload)) + payload], [0, 1, 2])
    replies = connection.makefile("r")
    pid = int(replies.readline())
    for number in FORWARDED_SIGNALS:
        signal.signal(number, lambda received, _: os.kill(pid, received))
    how, value = replies.readline().split()
    if how == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    sys.exit(int(value))


class Zygote:
    """A test worker's zygote, started at its first warm launch; gone with the worker (its stdin closes)."""

    def __init__(self):
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.pop("WORLD_SIZE", None)
        directory = Path(tempfile.mkdtemp(prefix="zaya-zygote-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        self.path = str(directory / "socket")
        self.log = directory / "zygote.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, __file__, "serve", self.path], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=directory,
                                            text=True)
        # importing PRELOAD printed nothing (to stdout: before "ready"; to stderr: the log)
        self.ready = self.process.stdout.readline() == "ready\n" and not self.log.read_text()

    def command(self, module: str, args: list[str], env: dict[str, str]) -> list[str] | None:
        """The client command that forks ``python -m MODULE ARGS`` with ``env``, or None if it must start fresh."""
        differing = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        if not self.ready or self.process.poll() is not None or differing - RUN_TIME_ENV:
            return None
        return [sys.executable, __file__, "client", self.path, module, *args]


_zygote_of_this_worker: list[Zygote] = []


def command(module: str, args: list[str], env: dict[str, str]) -> list[str] | None:
    """What runs ``python -m MODULE ARGS`` with ``env`` forked from this worker's zygote; None: start it fresh."""
    if not _zygote_of_this_worker:
        _zygote_of_this_worker.append(Zygote())
    return _zygote_of_this_worker[0].command(module, args, env)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _zygote(sys.argv[2])
    else:
        _client(sys.argv[2], sys.argv[3], sys.argv[4:])
